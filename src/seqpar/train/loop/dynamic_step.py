"""One optimizer step of length-aware SP (`sequence_parallel: {size: dynamic}`; docs/training.md).

The step takes the rows of the fixed run at the largest degree (GRPO: rolled out as that run would, then
gathered), plans them (seqpar.dynamic.schedule: the same plan on every rank, checked with one all-reduce of its
hash), and runs this rank's slot of each micro-step on that degree's group view. The loss denominator is
counted once per slot (by its group's first rank) and summed over the world; each slot's share is its rows'
loss over that global count, and the gradients are summed over the whole world (FSDP2: its reduce-scatter with
the world-size factor). So losses and gradients equal a fixed-SP run's over the same rows. Under FSDP2 every
rank runs one forward / backward per micro-step (an idle one a one-token dummy times 0), so its per-layer
all-gathers line up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ... import comm
from ... import loss as L
from ...dynamic.schedule import Row, Slot, StepPlan
from ...errors import SeqParError
from ...hf.attention import use_mesh
from ...steps import count_items, micro_batch_loss
from ...threaded import cpu_time
from ..config import rows_per_step
from .dynamic import dummy_batch, example_rows
from .grads import maybe_dump_grads
from .state import Loop
from .step import apply_update, metered, peak_memory_mb

__all__ = ["StepRows", "dynamic_rows", "dynamic_train_step", "measured_dynamic_step", "metric_names"]

DPO_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")  # seqpar.loss.dpo_loss
GRPO_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                "clip_ratio/high_max", "entropy")  # seqpar.loss.grpo_loss (+ "kl" with beta != 0)


def metric_names(cfg: Any) -> tuple[str, ...]:
    """The per-micro-batch metrics of the stage, the same on every rank (summed over the world in one call even
    where a rank led no slot)."""
    if cfg.stage == "dpo":
        return DPO_METRICS
    if cfg.stage == "grpo":
        return GRPO_METRICS + (("kl",) if cfg.grpo.beta != 0 else ())
    return ()


@dataclass
class StepRows:
    """A step's rows: the data the collators take, the scheduler's view of them, GRPO's advantages."""

    data: list
    rows: list[Row]
    advantages: torch.Tensor | None = None
    metrics: dict | None = None
    planned: tuple[StepPlan, list] | None = None  # GRPO num_iterations > 1: the first pass's plan and batches


def _rollout_rows(loop: Loop, step: int) -> tuple[StepRows, dict]:
    data, adv, metrics = loop.rollout.step_rows(loop.model, loop.streams[0], step)
    cap = loop.cfg.dataset.max_length
    return StepRows(data, [Row(j, min(len(r["input_ids"]), cap)) for j, r in enumerate(data)], adv), metrics


def dynamic_rows(loop: Loop, step: int) -> StepRows:
    """The step's rows from the run's one stream (GRPO: rolled out first, outside the memory meter)."""
    cfg = loop.cfg
    if loop.rollout is not None:  # num_iterations: the same StepRows for a rollout's passes (`planned` persists)
        t0 = time.perf_counter()
        rows, metrics = loop.rollout.reused(step, lambda: _rollout_rows(loop, step))
        rows.metrics = {**metrics, "rollout_s": time.perf_counter() - t0}
        return rows
    idx = loop.streams[0].take(rows_per_step(cfg, loop.mesh.dp_size))
    return StepRows([loop.examples[i] for i in idx], example_rows(cfg, loop.examples, idx))


def _agree(plan: StepPlan, loop: Loop) -> None:
    """Every rank planned the same step (deterministic arithmetic on the same rows), checked before any slot
    communicates: a rank with another plan would wait in collectives no one else joins."""
    if loop.world == 1:
        return
    key = tuple((s.degree, s.first, s.micro_step, tuple(r.index for r in s.rows)) for s in plan.slots)
    h = float(hash(key) % 2**52)
    got = comm.all_reduce_values([h, -h], dist.group.WORLD, loop.mesh.comm_device, op=dist.ReduceOp.MAX).tolist()
    if got[0] != -got[1]:
        raise SeqParError("the ranks planned this length-aware step differently (their rows or code differ): "
                          "every rank must run the same seqpar and read the same dataset")


def _collate(loop: Loop, slot: Slot, rows: StepRows) -> dict[str, Any]:
    batch = loop.dynamic.collators[slot.degree]([rows.data[r.index] for r in slot.rows])
    if rows.advantages is not None:
        batch["advantages"] = rows.advantages[[r.index for r in slot.rows]].to(torch.float32)
    return batch


def _planned(loop: Loop, rows: StepRows) -> tuple[StepPlan, list]:
    """The step's plan and this rank's slots collated; a GRPO rollout's later passes (num_iterations) reuse its
    first pass's, whose batches hold the old log-probs (StepSpec.keep_old_logps)."""
    if rows.planned is not None:
        return rows.planned
    plan = loop.dynamic.scheduler.plan(rows.rows, lockstep=loop.dynamic.lockstep)
    _agree(plan, loop)
    batches = [_collate(loop, s, rows) if s is not None else None for s in plan.of_rank(loop.rank)]
    if loop.spec.keep_old_logps:
        rows.planned = (plan, batches)
    return plan, batches


def _counts(loop: Loop, mine: list, batches: list) -> torch.Tensor:
    """The step's loss denominator: each slot counted by its group's first rank, summed over the world."""
    lead = [b for s, b in zip(mine, batches) if s is not None and s.first == loop.rank]
    zero = torch.zeros(2 if loop.cfg.stage == "grpo" else (), dtype=torch.long)
    local = count_items(lead, loop.cfg.stage) if lead else zero
    return L.global_token_count(local, loop.dynamic.meshes.world_mesh)


def _on_mesh(loop: Loop, mesh: Any) -> None:
    """The model (and a reference model) run the next micro-batch on `mesh`."""
    use_mesh(loop.model, mesh)
    ref = loop.reference
    if ref is not None:
        if getattr(ref, "ref_model", None) is not None:
            use_mesh(ref.ref_model, mesh)
        if hasattr(ref, "mesh"):
            ref.mesh = mesh


def _run_slots(loop: Loop, mine: list, batches: list, num_items: torch.Tensor) -> tuple[torch.Tensor, list, float]:
    """Forward and backward of this rank's slots in micro-step order; (share sum, [weighted metric sums, weight],
    busy seconds)."""
    dyn, share_sum, busy = loop.dynamic, torch.zeros((), dtype=torch.float32), 0.0
    sums: dict[str, float] = {}
    weight = 0.0
    for k, (slot, batch) in enumerate(zip(mine, batches)):
        if loop.cfg.fsdp:
            loop.model.set_requires_gradient_sync(k == len(mine) - 1)
        if slot is None:
            if dyn.lockstep:  # FSDP2: every forward all-gathers over the world (timed: the plan costs it, idle_s)
                _on_mesh(loop, dyn.meshes.view(1))
                t0 = time.perf_counter()
                share, _ = micro_batch_loss(loop.model, dummy_batch(dyn, loop.collator.pad_token_id), num_items,
                                            dyn.meshes.view(1), loop.spec, loop.reference)
                (share * 0.0).backward()
                busy += time.perf_counter() - t0
            continue
        view = dyn.meshes.view(slot.degree)
        _on_mesh(loop, view)
        t0 = time.perf_counter()
        share, met = micro_batch_loss(loop.model, batch, num_items, view, loop.spec, loop.reference)
        (share * loop.factor).backward()
        busy += time.perf_counter() - t0
        share_sum += share.detach().float().cpu()
        if met and slot.first == loop.rank:  # per-slot means (identical on its ranks), weighted by its rows
            w = float(len(slot.rows))  # pairs (DPO), completion rows (GRPO)
            weight += w
            for name, v in met.items():
                sums[name] = sums.get(name, 0.0) + float(v) * w
    return share_sum, [sums, weight], busy


def dynamic_train_step(loop: Loop, step: int, rows: StepRows) -> dict[str, Any]:
    """One optimizer step of length-aware SP; returns its metrics row (train_step's, plus the plan's)."""
    dyn = loop.dynamic
    t0, c0 = time.perf_counter(), cpu_time()
    plan, batches = _planned(loop, rows)
    mine = plan.of_rank(loop.rank)
    num_items = _counts(loop, mine, batches)
    share_sum, (sums, weight), busy = _run_slots(loop, mine, batches, num_items)
    _on_mesh(loop, loop.mesh)  # evals (and anything else between steps) run as the fixed run at the largest degree
    loss_val, gnorm, finite = _update(loop, step, share_sum)
    lead = sum(int(b["num_input_tokens"]) for s, b in zip(mine, batches) if s is not None and s.first == loop.rank)
    names = metric_names(loop.cfg)
    unknown = sorted(set(sums) - set(names))
    if unknown:
        raise SeqParError(f"length-aware SP does not know how to sum the micro-batch metrics {unknown}")
    tot = [float(lead), busy, weight, *(sums.get(n, 0.0) for n in names)]
    top = [peak_memory_mb(loop.device), cpu_time() - c0, busy]
    if loop.world > 1:
        tot = comm.all_reduce_values(tot, dist.group.WORLD, loop.mesh.comm_device).tolist()
        top = comm.all_reduce_values(top, dist.group.WORLD, loop.mesh.comm_device, op=dist.ReduceOp.MAX).tolist()
    dt = time.perf_counter() - t0
    predicted = plan.busy(dyn.scheduler.idle_s if dyn.lockstep else 0.0)
    row = {"step": step + 1, "loss": loss_val, "lr": loop.scheduler.get_last_lr()[0], "grad_norm": gnorm,
           "tokens": int(tot[0]), "supervised": int(num_items.reshape(-1)[-1]), "tokens_per_s": tot[0] / dt,
           "step_s": dt, "step_cpu_s": float(top[1]), "peak_mem_mb": float(top[0]), "nonfinite": int(not finite),
           "sp_degrees": {str(d): n for d, n in plan.degrees.items()}, "micro_steps": plan.micro_steps,
           "rank_s_max": float(top[2]), "rank_s_mean": tot[1] / loop.world,
           "predicted_rank_s_max": max(predicted), "predicted_rank_s_mean": sum(predicted) / loop.world,
           "predicted_step_s": dyn.scheduler.step_s(plan, dyn.lockstep)}
    row.update({n: tot[3 + i] / max(tot[2], 1e-30) for i, n in enumerate(names)})
    return {**row, **(rows.metrics or {})}


def _update(loop: Loop, step: int, share_sum: torch.Tensor) -> tuple[float, float, bool]:
    """Gradients summed over the world (FSDP2 reduced its shards in the last backward), clipped; the update.
    Returns (the step's loss, the gradient norm, whether it updated)."""
    if loop.prec:
        loop.prec.grads_to_masters()
    world_mesh = loop.dynamic.meshes.world_mesh
    if not loop.cfg.fsdp:
        L.sum_gradients(loop.params, world_mesh)
    maybe_dump_grads(loop.model, loop.params, step, loop.rank)  # for `seqpar verify` (env-triggered)
    top = loop.cfg.optimizer.max_grad_norm
    gnorm = torch.nn.utils.clip_grad_norm_(loop.params, top if top is not None else float("inf"))
    gnorm = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
    loss_val = float(L.global_loss(share_sum, world_mesh))
    return loss_val, gnorm, apply_update(loop, loss_val, gnorm)


def measured_dynamic_step(loop: Loop, step: int) -> dict[str, Any]:
    """dynamic_train_step inside the memory meter when there is one (GRPO's rollout outside it)."""
    rows = dynamic_rows(loop, step)
    return metered(loop, lambda: dynamic_train_step(loop, step, rows))
