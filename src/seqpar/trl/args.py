"""What the TRL drop-ins (trainer.py: SFT / DPO; grpo.py: GRPO) share before seqpar's HF Trainer drop-in takes
over: the TRL config they run (coerce_args), the model TRL would load (instantiate, PEFT applied before seqpar
patches it), the seqpar keyword arguments passed through, and the refusals common to all of them (SeqParError
naming the alternative, identically on every rank, before any collective).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SeqParError
from ..hf.trainer_args import check_dataset_rows
from ..mesh import SequenceParallelMesh

__all__ = ["coerce_args", "refuse", "refuse_common", "instantiate", "sp_kwargs", "refuse_moe_aux",
           "let_trl_configs_run_on_cpu", "check_trl_rows", "first_row", "refuse_video_columns"]


def let_trl_configs_run_on_cpu() -> None:
    """TRL's configs default to bf16=True, and on a machine without an accelerator transformers refuses that in the
    config's __post_init__ (a ValueError, "Your setup doesn't support bf16/gpu", from every rank) unless use_cpu:
    before TRL's own __post_init__, a bf16 config on such a machine gets use_cpu=True (the only device there, and
    what the drop-ins set on CPU ranks anyway); the drop-in then prints its one line about bf16 on CPU
    (seqpar.hf.trainer_args.BF16_ON_CPU). Called once by `import seqpar.trl`; machines with a GPU are untouched."""
    from trl.trainer.base_config import _BaseConfig

    if getattr(_BaseConfig.__post_init__, "_seqpar_cpu", False):
        return
    original = _BaseConfig.__post_init__

    def __post_init__(self: Any) -> None:
        bf16 = (not self.fp16) if self.bf16 is None else self.bf16
        if (bf16 or self.bf16_full_eval) and not self.use_cpu and torch.accelerator.current_accelerator() is None:
            self.use_cpu = True
        original(self)

    __post_init__._seqpar_cpu = True  # type: ignore[attr-defined]
    _BaseConfig.__post_init__ = __post_init__


def coerce_args(args: Any, config_cls: type, model: Any, suffix: str) -> Any:
    """The TRL config the stock trainer would build (a TrainingArguments is converted as TRL does)."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_cls(f"{name.split('/')[-1]}-{suffix}")
    if not isinstance(args, config_cls):
        from transformers import TrainingArguments

        if not isinstance(args, TrainingArguments):
            raise SeqParError(f"args must be a {config_cls.__name__} (or TrainingArguments), got {type(args).__name__}")
        d = args.to_dict()
        d["hub_token"] = args.hub_token
        args = config_cls(**d)
    return args


def refuse(name: str, what: str, why: str, instead: str) -> SeqParError:
    return SeqParError(f"{name}: {what} is not supported under sequence parallelism ({why}): {instead}")


def refuse_common(name: str, args: Any, data_collator: Any, kwargs: dict[str, Any]) -> None:
    """TRL options every SP drop-in refuses (vision datasets are each trainer's own: sft_vision.py, the DPO and
    GRPO collators)."""
    if data_collator is not None:
        raise refuse(name, "data_collator=", "the collator must shard TRL's prepared rows over the SP ranks",
                      "drop it; seqpar builds it from TRL's rows (packing= / max_length= / masks in the SFTConfig)")
    if getattr(args, "use_liger_kernel", False):
        raise refuse(name, "use_liger_kernel=True", "Liger's fused loss sees one shard and normalises locally",
                      "drop it; seqpar's fused chunked loss is on by default (fused_loss=True)")
    if getattr(args, "activation_offloading", False):
        raise refuse(name, "activation_offloading=True", "untested with the SP attention collectives",
                      "use gradient_checkpointing=True with gradient_checkpointing_kwargs={'offload': True}")
    if kwargs.get("compute_loss_func") is not None:
        raise refuse(name, "compute_loss_func=", "it would see sharded logits",
                      "drop it; the SFT loss is seqpar's global token-mean NLL")


def first_row(dataset: Any) -> Mapping[str, Any]:
    """A dataset's first row ({} for none, or for rows that are not mappings)."""
    if dataset is None:
        return {}
    try:
        row = next(iter(dataset))
    except (StopIteration, TypeError):
        return {}
    return row if isinstance(row, Mapping) else {}


def refuse_video_columns(name: str, why: str, instead: str, train_dataset: Any, eval_dataset: Any) -> None:
    """A "video" / "videos" column in the training or eval rows (eval: one dataset or a dict of them), from the
    column names or the first row: refused, naming `instead`."""
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    for ds in (train_dataset, *evals):
        if {"video", "videos"} & {*(getattr(ds, "column_names", None) or ()), *first_row(ds)}:
            raise refuse(name, "a video column ('video' / 'videos')", why, instead)


def instantiate(model: Any, args: Any, peft_config: Any) -> torch.nn.Module:
    """Load a model given by name (as TRL would) and wrap it with PEFT BEFORE seqpar patches it."""
    if isinstance(model, str):
        from trl.trainer.utils import create_model_from_path

        model = create_model_from_path(model, **dict(args.model_init_kwargs or {}))
    if peft_config is not None:
        from peft import get_peft_model

        if hasattr(model, "peft_config"):
            raise SeqParError("a PeftModel was passed together with peft_config=: pass one of them")
        from transformers import set_seed

        set_seed(args.seed)  # TRL seeds before get_peft_model: the same adapter init as the stock trainer
        # (TRL also calls enable_input_require_grads() here; seqpar's non-reentrant checkpointing needs no
        # grad-requiring embedding output, and the Trainer drop-in removes those hooks.)
        model = get_peft_model(model, peft_config)
    return model


def sp_kwargs(sequence_parallel_size: int | None, ulysses_degree: int | None, ring_degree: int | None,
               layout: str, mesh: SequenceParallelMesh | None, fused_loss: bool, loss_chunk_tokens: int | None,
               tiled_mlp: bool | int) -> dict[str, Any]:
    return {"sequence_parallel_size": sequence_parallel_size, "ulysses_degree": ulysses_degree,
            "ring_degree": ring_degree, "layout": layout, "mesh": mesh, "fused_loss": fused_loss,
            "loss_chunk_tokens": loss_chunk_tokens, "tiled_mlp": tiled_mlp}


def refuse_moe_aux(trainer: Any) -> None:
    if getattr(trainer, "aux_loss_enabled", False):
        raise refuse(type(trainer).__name__, "the MoE router auxiliary loss", "seqpar's loss does not add it",
                      "set router_aux_loss_coef=0.0 in the config")


TRL_ROWS = {  # what TRL's dataset preparation reads (formats, and what to do otherwise)
    "SFT": ("rename the columns (e.g. ds.rename_columns({'question': 'prompt', 'answer': 'completion'})), point "
            "dataset_text_field= at the text column, or pass formatting_func= (docs/trl.md)"),
    "DPO": "rename the columns to 'chosen' and 'rejected' (and 'prompt', unless both sides start with it)",
    "GRPO": ("rename the column holding the prompts (text or messages) to 'prompt'; every other column is passed to "
             "the reward functions"),
}


def check_trl_rows(name: str, kind: str, args: Any, train_dataset: Any, eval_dataset: Any,
                   kwargs: dict[str, Any]) -> None:
    """The raw rows are in a format TRL's preparation reads: otherwise a SeqParError on every rank at construction
    (TRL prepares the data on the main process first: its KeyError came on rank 0 while the others waited in a
    barrier, then failed with gloo's "Connection closed by peer")."""
    if kind == "SFT":
        if kwargs.get("formatting_func") is not None or (args.dataset_kwargs or {}).get("skip_prepare_dataset"):
            return
        formats = [(args.dataset_text_field,), ("messages",), ("prompt", "completion"), ("conversations",),
                   ("input_ids",)]
    else:
        formats = [("chosen", "rejected")] if kind == "DPO" else [("prompt",)]
    check_dataset_rows(name, {"train_dataset": train_dataset, "eval_dataset": eval_dataset}, formats, TRL_ROWS[kind])
