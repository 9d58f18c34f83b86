"""How close the local attention kernel runs to this core's matmul rate, and what that leaves for glue.

The Ulysses comparison with DeepSpeed (bench attention, part 3) runs the same torch CPU flash kernel on
the same per-rank shapes on both sides, so the CPU seconds of either are kernel + glue. Two figures say
how much a faster glue can still buy:

- `kernel_rate`: the kernel's useful GFLOP/s at one Ulysses rank's shape (full sequence, heads / P),
  forward and backward, on one thread, next to the same thread's fp32 matmul rate (`torch.mm` of
  square matrices: what the kernel's inner products could reach at best);
- `cpu_ratio_floor`: from a profile (self time per category), the kernel's share of the total. With the
  same kernel time and NO glue at all, seqpar's CPU seconds over the profiled peer's would be this share:
  a ratio target below it needs a faster kernel, not fewer copies.

Useful FLOPs count the unmasked causal entries only: forward 2 matmuls (QK^T, PV), backward 5 (QK^T
recomputed, dV, dP, dQ, dK), 2 FLOPs per multiply-add.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["causal_attention_flops", "kernel_rate", "cpu_ratio_floor"]


def causal_attention_flops(seq: int, heads: int, head_dim: int) -> dict[str, float]:
    """Useful FLOPs of one causal attention call (B = 1): the S(S+1)/2 unmasked scores per head."""
    pairs = seq * (seq + 1) / 2 * heads
    return {"fwd": 2 * 2 * pairs * head_dim, "bwd": 5 * 2 * pairs * head_dim}


def _best_thread_time(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def kernel_rate(seq: int, heads: int, head_dim: int, reps: int = 3, mm_size: int = 1024) -> dict[str, Any]:
    """Best-of-`reps` thread CPU time of the CPU flash kernel's forward and backward ([1, heads, seq,
    head_dim] fp32, causal) and of an fp32 [mm_size]^2 matmul, as GFLOP/s; `fraction_of_matmul` is the
    kernel's fwd+bwd rate over the matmul rate. Run it on one thread with the core otherwise idle."""
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, heads, seq, head_dim, generator=g) for _ in range(4))
    scale = head_dim**-0.5
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    out, lse = fwd(q, k, v, 0.0, True, attn_mask=None, scale=scale)
    t_fwd = _best_thread_time(lambda: fwd(q, k, v, 0.0, True, attn_mask=None, scale=scale), reps)
    t_bwd = _best_thread_time(lambda: bwd(dout, q, k, v, out, lse, 0.0, True, attn_mask=None, scale=scale), reps)
    a, b = (torch.randn(mm_size, mm_size, generator=g) for _ in range(2))
    t_mm = _best_thread_time(lambda: torch.mm(a, b), max(reps, 5))
    fl = causal_attention_flops(seq, heads, head_dim)
    mm_rate = 2 * mm_size**3 / t_mm / 1e9
    rate = (fl["fwd"] + fl["bwd"]) / (t_fwd + t_bwd) / 1e9
    return {
        "shape": {"seq_len": seq, "heads": heads, "head_dim": head_dim, "dtype": "float32", "causal": True},
        "threads": torch.get_num_threads(), "reps": reps,
        "fwd_s": t_fwd, "bwd_s": t_bwd,
        "fwd_gflops": fl["fwd"] / t_fwd / 1e9, "bwd_gflops": fl["bwd"] / t_bwd / 1e9, "fwd_bwd_gflops": rate,
        "matmul_size": mm_size, "matmul_gflops": mm_rate, "fraction_of_matmul": rate / mm_rate,
    }


def cpu_ratio_floor(profile: dict[str, float]) -> dict[str, float]:
    """The kernel's share of a profiled fwd+bwd (self seconds per category): the lowest CPU ratio anyone
    running the same kernel could reach against it (kernel time equal, zero glue)."""
    total = sum(profile.values())
    kernel = profile.get("kernel", 0.0)
    return {"kernel_s": kernel, "total_s": total, "glue_s": total - kernel,
            "floor": kernel / total if total > 0 else float("nan")}
