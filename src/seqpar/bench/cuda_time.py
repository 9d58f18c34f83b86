"""CUDA-event timing shared by the GPU benchmarks (bench.gpu, bench.gpu_hybrid)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["cuda_time_ms"]


def cuda_time_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """The median over `reps` calls of fn's GPU time in ms (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
