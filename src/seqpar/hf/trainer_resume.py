"""Resuming a drop-in from a Trainer checkpoint written at another layout (world size, sequence_parallel_size,
dp size).

What the stock Trainer's checkpoint holds is layout-free under DDP and FSDP2: the model and optimizer as full
state dicts (FSDP2's FULL_STATE_DICT: accelerate gathers and loads them resharded) or as torch.distributed.
checkpoint folders (SHARDED_STATE_DICT: resharded on load), a step-based schedule, and the data position as a
step count: the Trainer skips `global_step % steps_per_epoch x gradient_accumulation_steps` batches of the NEW
layout's loader. Those are the uninterrupted run's rows exactly when the global batch (dp x
per_device_train_batch_size x gradient_accumulation_steps) is the one that wrote the checkpoint, so a resume at
another layout with the same global batch continues the uninterrupted trajectory (losses are normalised over
the global token count and SP is exact), and one with another global batch would silently train on other rows:
it is refused. DeepSpeed ZeRO keeps one optimizer partition per rank and loads it only at the world size that
wrote it (SP size and dp may change at that world size: ZeRO partitions over all dp x sp ranks); at another
world size the checkpoint must first become a DeepSpeed universal checkpoint (refused, naming the conversion,
unless the DeepSpeed config loads one; ZeRO-3's universal loading did not resume exactly here: refused).

Each checkpoint gets `seqpar_layout.json` (rank 0); `check_resume` compares it with this run before the Trainer
loads anything, identically on every rank (file reads only), and rank 0 says what the layout change does.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import SeqParError
from .trainer_stack import deepspeed_config, deepspeed_stage

__all__ = ["LAYOUT_FILE", "trainer_layout", "write_layout", "check_resume", "resolve_checkpoint"]

LAYOUT_FILE = "seqpar_layout.json"


def trainer_layout(trainer: Any) -> dict[str, Any]:
    """This run's layout: world, dp x sp (ulysses x ring), the global batch and its factors, the stack, rows."""
    m, a = trainer.sp_mesh, trainer.args
    stage = deepspeed_stage(a)
    stack = f"deepspeed-zero{stage}" if stage is not None else ("fsdp2" if getattr(trainer, "is_fsdp_enabled", False)
                                                               else "ddp")
    rows = len(trainer.train_dataset) if trainer.train_dataset is not None else None
    return {"world": m.world_size, "dp": m.dp_size, "sp": m.sp_size, "ulysses": m.ulysses_degree,
            "ring": m.ring_degree, "per_device_train_batch_size": a.per_device_train_batch_size,
            "gradient_accumulation_steps": a.gradient_accumulation_steps,
            "global_batch": m.dp_size * a.per_device_train_batch_size * a.gradient_accumulation_steps,
            "stack": stack, "rows": rows}


def write_layout(trainer: Any, checkpoint_dir: str) -> None:
    """Record this run's layout in a checkpoint folder the Trainer just wrote (rank 0)."""
    if trainer.args.process_index == 0 and os.path.isdir(checkpoint_dir):
        with open(os.path.join(checkpoint_dir, LAYOUT_FILE), "w") as f:
            json.dump(trainer_layout(trainer), f, indent=2)


def resolve_checkpoint(trainer: Any, resume: str | bool | None) -> str | None:
    """The folder `train(resume_from_checkpoint=resume)` will load (True: the output_dir's last checkpoint)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(trainer.args.output_dir)
    return str(resume)


def _mesh(x: dict[str, Any]) -> str:
    return (f"world {x['world']} (dp {x['dp']} x sp {x['sp']}: ulysses {x['ulysses']} x ring {x['ring']}, "
            f"{x['stack']})")


def _batch(x: dict[str, Any]) -> str:
    return (f"dp {x['dp']} x per_device_train_batch_size {x['per_device_train_batch_size']} x "
            f"gradient_accumulation_steps {x['gradient_accumulation_steps']}")


def _loads_universal(trainer: Any) -> bool:
    ds = deepspeed_config(trainer.args)
    return bool(ds is not None and ds.get_value("checkpoint.load_universal", False))


def _check_universal(trainer: Any, checkpoint: str, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """A DeepSpeed ZeRO checkpoint at another world size: only as a universal checkpoint of ZeRO-1/2."""
    name, w = type(trainer).__name__, saved["world"]
    step = os.path.basename(os.path.normpath(checkpoint)).split("-")[-1]
    where = f"{checkpoint} is a DeepSpeed {saved['stack']} checkpoint of {w} ranks and this run has {now['world']}"
    if saved["stack"] == "deepspeed-zero3":
        raise SeqParError(
            f"{name}: {where}: DeepSpeed loads a ZeRO-3 checkpoint at {w} ranks only, and its universal-checkpoint "
            f"loading of a ZeRO-3 run does not restore the optimizer exactly (DeepSpeed 0.19.8: the second step after "
            f"such a resume differed), so seqpar does not resume it here: resume on {w} ranks (sequence_parallel_size "
            f"and dp may change there), or use ZeRO-1/2, FSDP2 or DDP, which resume at any world size")
    universal = os.path.join(checkpoint, "latest_universal")
    if not (_loads_universal(trainer) and os.path.isfile(universal)):
        raise SeqParError(
            f"{name}: {where}: DeepSpeed keeps one optimizer partition per rank and loads them at {w} ranks only. To "
            f"resume at {now['world']}, convert it to a DeepSpeed universal checkpoint: python -m deepspeed."
            f"checkpoint.ds_to_universal --inject_missing_state --input_folder {checkpoint}/global_step{step} "
            f"--output_folder {checkpoint}/global_step{step}_universal, write global_step{step}_universal into "
            f"{universal}, and set \"checkpoint\": {{\"load_universal\": true}} in the DeepSpeed config; or resume "
            f"on {w} ranks (sequence_parallel_size and dp may change there)")


def check_resume(trainer: Any, checkpoint: str) -> list[str]:
    """Refuse a resume the Trainer cannot continue exactly at this layout (SeqParError naming the fix); the
    lines that say what a layout change does (empty: same layout, or a checkpoint without a layout record)."""
    path = os.path.join(checkpoint, LAYOUT_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        saved = json.load(f)
    now = trainer_layout(trainer)
    name = type(trainer).__name__
    if saved["global_batch"] != now["global_batch"]:
        per = now["dp"] * now["per_device_train_batch_size"]
        fix = (f"gradient_accumulation_steps={saved['global_batch'] // per}" if saved["global_batch"] % per == 0
               else f"per_device_train_batch_size x gradient_accumulation_steps = {saved['global_batch']} / dp")
        raise SeqParError(
            f"{name}: {checkpoint} was written with a global batch of {saved['global_batch']} rows ({_batch(saved)}) "
            f"and this run has {now['global_batch']} ({_batch(now)}): the Trainer resumes by skipping steps of the "
            f"new batch, so it would continue from other rows. Keep the global batch ({fix}), or start fresh")
    if saved["stack"].startswith("deepspeed") and saved["world"] != now["world"]:
        _check_universal(trainer, checkpoint, saved, now)
    return _notes(saved, now, checkpoint)


def _notes(saved: dict[str, Any], now: dict[str, Any], checkpoint: str) -> list[str]:
    keys = ("world", "dp", "sp", "ulysses", "ring", "stack")
    if all(saved[k] == now[k] for k in keys):
        return []
    lines = [f"{os.path.basename(os.path.normpath(checkpoint))} was written at {_mesh(saved)}, this run is "
             f"{_mesh(now)}; global batch kept: {now['global_batch']} rows per step ({_batch(saved)} -> "
             f"{_batch(now)}): the run continues as the uninterrupted one would"]
    rows = now["rows"]
    if rows and saved["dp"] != now["dp"] and (rows % saved["dp"] or rows % now["dp"]):
        lines.append(f"{rows} training rows are not a multiple of dp {saved['dp']} and {now['dp']}: the sampler pads "
                     f"each epoch by repeating its first rows up to a multiple of dp, so the rows at the end of each "
                     f"epoch differ from the uninterrupted run's")
    return lines
