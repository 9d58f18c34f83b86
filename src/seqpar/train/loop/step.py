"""One optimizer step of the loop: the step's micro-batches (every dp slot this process plays), their
losses against the step's global denominator, gradients summed over dp x sp, clipping, and the update
(skipped when the loss or gradient norm is not finite); optionally inside the exact memory meter.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ... import comm
from ... import loss as L
from ...steps import count_items, micro_batch_loss
from ...threaded import cpu_time
from .grads import maybe_dump_grads
from .state import Loop

__all__ = ["train_step", "measured_step", "metered", "next_micro_batches", "backward_micro_batches", "apply_update",
           "peak_memory_mb"]


def next_micro_batches(loop: Loop) -> list[dict[str, torch.Tensor]]:
    cfg = loop.cfg
    rows_per_micro = 1 if cfg.dataset.packing else cfg.micro_batch_size
    micro: list[dict[str, torch.Tensor]] = []
    for stream in loop.streams:
        for _ in range(cfg.grad_accum):
            idx = stream.take(rows_per_micro)
            batch_rows = loop.examples[idx[0]] if cfg.dataset.packing else [loop.examples[i] for i in idx]
            micro.append(loop.collator(batch_rows))
    return micro


def train_step(loop: Loop, step: int, prepared: tuple[list, dict] | None = None) -> dict[str, Any]:
    """One optimizer step (all micro-batches of every dp slot this process plays); returns its metrics row.
    prepared: (micro-batches, extra metrics) built beforehand (stage: grpo, see measured_step)."""
    cfg, mesh = loop.cfg, loop.mesh
    t0, c0 = time.perf_counter(), cpu_time()
    micro, rollout_metrics = prepared if prepared is not None else (next_micro_batches(loop), {})
    # Global denominator first: all micro-batches of the step, then over dp (pitfalls 4 and 5).
    num_items = L.global_token_count(count_items(micro, cfg.stage), mesh)
    share_sum, dpo_metrics = backward_micro_batches(loop, micro, num_items)
    if loop.prec:
        loop.prec.grads_to_masters()
    if loop.grad_sum is not None:
        loop.grad_sum.finish()
    elif not cfg.fsdp:
        L.sum_gradients(loop.params, mesh)
    maybe_dump_grads(loop.model, loop.params, step, loop.rank)  # for `seqpar verify` (env-triggered)
    o = cfg.optimizer
    max_norm = o.max_grad_norm if o.max_grad_norm is not None else float("inf")
    gnorm = torch.nn.utils.clip_grad_norm_(loop.params, max_norm)
    gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    loss_val = float(L.global_loss(share_sum, mesh))
    finite = apply_update(loop, loss_val, float(gnorm))
    tokens = int(L.global_token_count(sum(int(b["num_input_tokens"]) for b in micro), mesh))
    # process CPU s of the step (every thread: gloo's transfers too, not waiting): the work, whatever the load
    stats = [peak_memory_mb(loop.device), cpu_time() - c0]
    if loop.world > 1:
        # Host-side numbers travel on the mesh's communication device (NCCL refuses CPU tensors).
        stats = comm.all_reduce_values(stats, dist.group.WORLD, mesh.comm_device, op=dist.ReduceOp.MAX).tolist()
        if dpo_metrics:
            mt = comm.all_reduce_values(list(dpo_metrics.values()), mesh.dp_group, mesh.comm_device)
            dpo_metrics = dict(zip(dpo_metrics, (mt / mesh.dp_size).tolist()))
    dt = time.perf_counter() - t0
    return {"step": step + 1, "loss": loss_val, "lr": loop.scheduler.get_last_lr()[0], "grad_norm": float(gnorm),
            "tokens": tokens, "supervised": int(num_items.reshape(-1)[-1]), "tokens_per_s": tokens / dt,
            "step_s": dt, "step_cpu_s": float(stats[1]), "peak_mem_mb": float(stats[0]), "nonfinite": int(not finite),
            **dpo_metrics, **rollout_metrics}


def backward_micro_batches(loop: Loop, micro: list[dict[str, torch.Tensor]],
                           num_items: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and backward of every micro-batch of the step (gradients accumulate; only the last backward
    syncs: FSDP's reduce-scatter, or the overlapped gradient sum). Returns (sum of loss shares, metrics)."""
    share_sum = torch.zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    try:
        for j, b in enumerate(micro):
            last = j == len(micro) - 1
            if loop.cfg.fsdp:
                loop.model.set_requires_gradient_sync(last)
            if last and loop.grad_sum is not None:
                loop.grad_sum.arm()
            share, met = micro_batch_loss(loop.model, b, num_items, loop.mesh, loop.spec, loop.reference)
            (share * loop.factor).backward()
            share_sum += share.detach().float().cpu()
            for k, v in met.items():
                metrics[k] = max(metrics.get(k, 0.0), float(v)) if k == _DIFF_MAX else \
                    metrics.get(k, 0.0) + float(v) / len(micro)
    except BaseException:
        if loop.grad_sum is not None:  # a later step's first backwards must not post sums
            loop.grad_sum.disarm()
        raise
    if "rollout_logprob_diff_sum" in metrics:  # the step's mean over every completion token (sums over count)
        total, count = metrics.pop("rollout_logprob_diff_sum"), metrics.pop("rollout_logprob_diff_count")
        metrics["rollout_logprob_diff_mean"] = total / max(count, 1e-30)
    return share_sum, metrics


_DIFF_MAX = "rollout_logprob_diff_max"  # the step's max over micro-batches (not their mean)


def apply_update(loop: Loop, loss: float, grad_norm: float) -> bool:
    """Optimizer + scheduler step, unless the loss or gradient norm is NaN/inf: then the gradients are
    dropped and the parameters stay as they are (the scheduler still advances: lr stays a function of
    the step number). Both values are global, so every rank decides alike. Returns whether it updated."""
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        loop.optimizer.step()
        if loop.prec:
            loop.prec.masters_to_model()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)
    loop.nonfinite_streak = 0 if finite else loop.nonfinite_streak + 1
    return finite


def measured_step(loop: Loop, step: int) -> dict[str, Any]:
    """train_step inside the memory meter (memory.measure): adds peak_alloc_mb, the max over ranks.
    stage: grpo: generation and rewards run first, outside the meter (its module hooks are for training)."""
    prepared = None
    if loop.rollout is not None:
        t0 = time.perf_counter()
        prepared = loop.rollout.step_batches(loop.model, loop.streams[0], step)
        prepared[1]["rollout_s"] = time.perf_counter() - t0
    return metered(loop, lambda: train_step(loop, step, prepared))


def metered(loop: Loop, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """run() (one step, returning its metrics row) inside the memory meter when there is one: the row gets
    peak_alloc_mb, the max over ranks (and offloaded_peak_mb with activation offload)."""
    if loop.meter is None:
        return run()
    with loop.meter.measure():
        row = run()
    peak = [float(loop.meter.last["peak_bytes"])]
    if loop.world > 1:
        peak = comm.all_reduce_values(peak, dist.group.WORLD, loop.mesh.comm_device, op=dist.ReduceOp.MAX).tolist()
    row["peak_alloc_mb"] = float(peak[0]) / 2**20
    if loop.meter.last.get("offloaded_peak_bytes"):  # activation offload: this rank's host bytes at most
        row["offloaded_peak_mb"] = float(loop.meter.last["offloaded_peak_bytes"]) / 2**20
    if loop.meter.last.get("host_state_bytes"):  # FSDP2's CPU offload: parameters / optimizer state on the host
        row["host_state_mb"] = float(loop.meter.last["host_state_bytes"]) / 2**20
    return row


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
