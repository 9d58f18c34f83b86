"""The rates length-aware SP balances with, timed on the device the run trains on (at its start, in a second or
less), so that the cost model's ratios of matmul to attention work are this device's, not a preset's.

- `matmul_flops(device, dtype)`: a layer-sized matmul's achieved FLOP/s;
- `attention_rates(device, dtype, head_dim)`: the causal attention kernel's forward + backward rate at 256, 1024
  and 4096 tokens (forward FLOPs x 3.5, as planner.calibrate counts them), in TFLOP/s;
- `agree(values, group, device)`: every rank takes the slowest rank's numbers (the plan must be the same on every
  rank).
Each is the median of a few timed calls after a warm-up. planner.calibrate measures a whole cluster with the same
functions (and the collectives, which a training run does not re-measure).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["typical_s", "matmul_flops", "attention_rates", "agree", "ATTN_LENGTHS"]

ATTN_LENGTHS = (256, 1024, 4096)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def typical_s(fn: Callable[[], Any], reps: int = 5, device: torch.device | None = None) -> float:
    """Median seconds of `reps` calls after a warm-up."""
    dev = device or torch.device("cpu")
    fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """FLOP/s of a (tokens x hidden) @ (hidden x 3 hidden) matmul: 1024 x 256 x 768 on a CPU, 8x each way on a
    GPU (a small one would time the launch)."""
    m, k, n = (1024, 256, 768) if device.type == "cpu" else (8192, 2048, 6144)
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / typical_s(lambda: a @ b, reps, device)


def attention_rates(device: torch.device, dtype: torch.dtype = torch.float32, head_dim: int = 32, heads: int = 4,
                    lengths: Sequence[int] = ATTN_LENGTHS, reps: int = 3) -> tuple[tuple[int, float], ...]:
    """(length, TFLOP/s) of causal attention forward + backward (torch's SDPA: the kernel 'auto' resolves to on
    this device) per length: the rate grows with the length (fewer masked blocks, longer loops)."""
    out = []
    for n in lengths:
        q, k, v = (torch.randn(1, heads, n, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))

        def run(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        flops = 4 * heads * head_dim * n * (n + 1) / 2 * 3.5  # causal forward FLOPs x (1 + 2.5 backward)
        out.append((n, flops / typical_s(run, reps, device) / 1e12))
    return tuple(out)


def agree(values: Sequence[float], group: Any, device: torch.device) -> list[float]:
    """The smallest of each value over the ranks of `group` (rates: the slowest rank's), the same on every rank."""
    import torch.distributed as dist

    from ..comm import all_reduce_values

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    return all_reduce_values(list(values), group, device, op=dist.ReduceOp.MIN).tolist()
