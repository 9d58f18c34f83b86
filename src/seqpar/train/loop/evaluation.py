"""Eval loss under SP: the training step's sharded forward, without gradients, over a fixed eval set.

Every eval row is counted exactly once: dp rank d takes rows d, d + dp, d + 2 dp, ... (no
wrap-around padding, unlike the training sampler). A dp rank with fewer batches than the longest
one still runs a forward for each missing batch (on row 0, its result discarded), so every rank
joins the same collectives (SP attention, FSDP all-gathers). The loss is the global token mean for
SFT (pair mean for DPO): the sum of every rank's loss share over dp x sp, divided by the global count.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from ... import loss as L
from ...mesh import SequenceParallelMesh
from ...steps import StepSpec, count_items, micro_batch_loss
from .metrics import log_row
from .state import Loop, TrainResult

__all__ = ["eval_batches", "evaluate", "maybe_eval"]


def eval_batches(n_examples: int, dp_size: int, dp_rank: int, rows_per_batch: int) -> list[list[int] | None]:
    """This dp rank's row indices per batch; None = a filler batch (this rank ran out of rows)."""
    mine = list(range(dp_rank, n_examples, dp_size))
    n_batches = math.ceil(math.ceil(n_examples / dp_size) / rows_per_batch)
    batches: list[list[int] | None] = [mine[i:i + rows_per_batch] for i in range(0, len(mine), rows_per_batch)]
    return batches + [None] * (n_batches - len(batches))


@torch.no_grad()
def evaluate(model: torch.nn.Module, examples: list, collator: Any, mesh: SequenceParallelMesh, spec: StepSpec,
             reference: Any = None, rows_per_batch: int = 1, packing: bool = False) -> tuple[float, int]:
    """(global mean eval loss, global item count) over all `examples`; call on every rank."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    items = torch.zeros((), dtype=torch.long)
    try:
        for idx in eval_batches(len(examples), mesh.dp_size, mesh.dp_rank, 1 if packing else rows_per_batch):
            rows_idx = idx if idx is not None else [0]
            rows = examples[rows_idx[0]] if packing else [examples[i] for i in rows_idx]
            batch = collator(rows)
            # Denominator 1: this rank's share of the SUM of losses; normalised once at the end.
            share, _ = micro_batch_loss(model, batch, torch.ones((), dtype=torch.long), mesh, spec, reference)
            if idx is not None:
                total += share.detach().double().cpu()
                items += count_items([batch], spec.stage).cpu()
    finally:
        model.train(was_training)
    total = L.global_loss(total, mesh)
    n = L.global_token_count(items, mesh)
    return float(total) / max(int(n), 1), int(n)


def maybe_eval(loop: Loop, result: TrainResult, metrics_path: Path, step: int) -> None:
    """Eval every cfg.eval_every steps and after the last one (all ranks; rank 0 logs)."""
    cfg = loop.cfg
    if loop.eval_examples is None:
        return
    if not (step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0)):
        return
    t0 = time.perf_counter()
    ev = cfg.eval_dataset
    loss, items = evaluate(loop.model, loop.eval_examples, loop.eval_collator, loop.mesh, loop.spec, loop.reference,
                           rows_per_batch=cfg.micro_batch_size, packing=ev.packing)
    result.eval_losses.append((step, loss))
    if loop.rank == 0:
        log_row(loop, metrics_path, {"step": step, "eval_loss": loss, "eval_items": items,
                                      "eval_s": time.perf_counter() - t0})
