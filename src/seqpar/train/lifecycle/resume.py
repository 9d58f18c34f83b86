"""Resume rules: which checkpoint a run continues from, and refusing one written by a different run.

Reads files only (no collectives), so every rank -- and the launching `seqpar train --nproc-per-node`
process, before torchrun starts -- reaches the same decision with the same message.

A checkpoint continues a run only when what shapes the training trajectory is unchanged: the keys in
`MUST_MATCH` and the world size. `max_steps` may change (grow, to train longer), and so may
checkpointing, export, progress, memory and FSDP settings (exactness features: same loss and gradients).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import SeqParError
from ..config import TrainConfig
from .checkpoint import latest_checkpoint

__all__ = ["run_meta", "MUST_MATCH", "find_resume", "config_differences", "resume_point"]

MUST_MATCH = ("model", "dataset", "stage", "dpo", "grpo", "finetuning", "sequence_parallel", "precision", "optimizer",
              "schedule", "micro_batch_size", "grad_accum", "seed")


def run_meta(cfg: TrainConfig, world: int) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (checkpoint-N/run.json)."""
    return {"config": cfg.model_dump(mode="json"), "world_size": world}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    return out


def config_differences(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Dotted keys (within MUST_MATCH) whose value differs, as 'key: saved -> now'."""
    now = cfg.model_dump(mode="json")
    diffs = []
    for top in MUST_MATCH:
        a, b = _flatten(saved.get(top), top), _flatten(now.get(top), top)
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                diffs.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return diffs


def _saved_meta(ckpt: Path) -> dict[str, Any] | None:
    run = ckpt / "run.json"
    if run.is_file():
        return json.loads(run.read_text())
    cfg = ckpt.parent / "config.json"  # checkpoints written before run.json existed
    if cfg.is_file():
        ranks = len(list(ckpt.glob("trainer_state_rank*.pt")))
        return {"config": json.loads(cfg.read_text()), "world_size": ranks}
    return None


def find_resume(cfg: TrainConfig, world: int) -> tuple[Path, int] | None:
    """(checkpoint, step) this run resumes from, None for a fresh start; SeqParError when it may not resume."""
    if not cfg.checkpoint.resume:
        return None
    ckpt = latest_checkpoint(cfg.output_dir)
    if ckpt is None:
        return None
    step = int(ckpt.name.rsplit("-", 1)[-1])
    fresh = ("to start fresh, set checkpoint.resume: false (--set checkpoint.resume=false) or use a new "
             "output_dir; to continue, run with the checkpoint's settings")
    meta = _saved_meta(ckpt)
    if meta is None:
        raise SeqParError(f"{ckpt} (step {step}) has no run.json and {ckpt.parent / 'config.json'} is missing, so "
                          f"it cannot be checked against this config: {fresh}")
    diffs = config_differences(meta["config"], cfg)
    if int(meta["world_size"]) != world:
        diffs.append(f"world size (processes): {meta['world_size']} -> {world}")
    if diffs:
        raise SeqParError(
            f"cannot resume from {ckpt} (step {step}): the run that wrote it differs in\n  " + "\n  ".join(diffs)
            + f"\n{fresh}"
        )
    return ckpt, step


def resume_point(cfg: TrainConfig, world: int, rank: int, out: Path) -> Path | None:
    """The checkpoint to resume from (announced), or None; a fresh start forgets older checkpoints' marker."""
    found = find_resume(cfg, world)
    if found is None:
        if rank == 0 and latest_checkpoint(out) is not None:
            (out / "latest").unlink()  # checkpoint.resume: false: a later resume must not pick the old run's
        return None
    if rank == 0:
        print(f"[seqpar] resuming from step {found[1]}: {found[0]}", flush=True)
    return found[0]
