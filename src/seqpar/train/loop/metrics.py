"""What the loop writes for people: metrics.jsonl rows (rank 0), TensorBoard scalars when asked, and the
data pipeline's truncation / drop counts printed once at the start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..dataset.prompts import describe_prompt_stats
from ..dataset.tokenize import describe_stats
from .state import Loop

__all__ = ["log_row", "open_tensorboard", "report_data_stats", "trim_metrics"]


def log_row(loop: Loop, metrics_path: Path, row: dict[str, Any]) -> None:
    """Rank 0: one metrics.jsonl row, and its numbers as TensorBoard scalars when asked."""
    with open(metrics_path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    if loop.tensorboard is not None:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                loop.tensorboard.add_scalar(f"{'eval' if k.startswith('eval_') else 'train'}/{k}", v, row["step"])
        loop.tensorboard.flush()


def open_tensorboard(cfg: TrainConfig, rank: int, out: Path) -> Any:
    if rank != 0 or "tensorboard" not in cfg.report_to:
        return None
    from torch.utils.tensorboard import SummaryWriter  # needs `pip install tensorboard` (checked at launch)

    return SummaryWriter(log_dir=str(out / "tensorboard"))


def report_data_stats(cfg: TrainConfig, rank: int, stats: dict, eval_stats: dict | None) -> None:
    """Rank 0 prints what the data pipeline truncated or dropped (rows are never changed silently)."""
    if rank != 0:
        return
    lines = (describe_prompt_stats(stats, cfg.grpo.max_prompt_length) if cfg.stage == "grpo"
             else describe_stats(stats, cfg.dataset.max_length))
    if eval_stats is not None:
        lines += describe_stats(eval_stats, cfg.eval_dataset.max_length, "eval_dataset")
    for line in lines:
        print(f"[seqpar] {line}", flush=True)


def trim_metrics(path: Path, keep_upto: int) -> None:
    """Fresh run: start an empty file; resumed run: drop rows logged after the checkpoint."""
    if keep_upto == 0 or not path.exists():
        path.write_text("")
        return
    kept, torn = [], 0
    for ln in path.read_bytes().decode("utf-8", "replace").splitlines():
        try:
            if ln.strip() and int(json.loads(ln)["step"]) <= keep_upto:
                kept.append(ln)
        except (ValueError, KeyError, TypeError):  # a row cut short by a crash or a full disk
            torn += bool(ln.strip())
    if torn:
        print(f"[seqpar] {path}: dropped {torn} unreadable row(s) (a write cut short by a crash or a full disk)",
              flush=True)
    path.write_text("".join(ln + "\n" for ln in kept))
