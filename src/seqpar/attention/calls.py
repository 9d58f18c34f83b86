"""Run one planned kernel call (`pieces.KernelCall`) on local tensors: gather its rows, call the kernel, and
hand back results in the call's row order. Shared by the ring (which merges) and the local attention
(which writes in place), so the gather / scatter rules are written once.

Layouts: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], lse [B, Sq, Hq]. A call with one piece runs the kernel's
dense form on slices (views; any B). A call with several pieces runs its varlen form on [T, H, D] rows
(B == 1 only: `varlen_ok`): a view when the pieces' ranges are adjacent, one concatenation otherwise.
"""

from __future__ import annotations

import torch

from .kernels import AttentionKernel
from .pieces import KernelCall

__all__ = ["varlen_ok", "window_tile", "take_rows", "put_rows", "call_forward", "call_backward"]

MIN_TILE = 64  # q rows of a banded piece at least: fewer, larger calls for small windows


def window_tile(kernel: AttentionKernel, window: int | None) -> int | None:
    """The q tile of a sliding window's banded pieces: None (whole rectangles) for a kernel that skips what is out
    of reach itself (FlashAttention's window), else max(window, MIN_TILE) rows, so a tile's masked call computes
    at most (tile + window) keys per row: work ~ S x window, not S^2."""
    if window is None or getattr(kernel, "native_window", False):
        return None
    return max(int(window), MIN_TILE)


def varlen_ok(kernel: AttentionKernel, batch: int) -> bool:
    """Whether calls may group pieces: the kernel has a varlen form and the rows are one packed row."""
    return batch == 1 and getattr(kernel, "varlen", False)


def take_rows(x: torch.Tensor, ranges) -> torch.Tensor:
    """x[:, ranges] along dim 1 in range order: a view when the ranges are adjacent, else one concatenation."""
    if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
        return x[:, ranges[0][0] : ranges[-1][1]]
    return torch.cat([x[:, a:b] for a, b in ranges], dim=1)


def put_rows(dst: torch.Tensor, src: torch.Tensor, ranges, add: bool) -> None:
    """dst[:, ranges] = (or +=) src, src's rows laid out in range order (the inverse of take_rows)."""
    t = 0
    for a, b in ranges:
        part = src[:, t : t + b - a]
        if add:
            dst[:, a:b] += part
        else:
            dst[:, a:b] = part
        t += b - a


def _band(call: KernelCall) -> tuple:
    """The extra kernel argument of a banded call (none otherwise: kernels without `band` run unwindowed calls)."""
    return () if call.band is None else (call.band,)


def call_forward(kernel: AttentionKernel, call: KernelCall, q, k, v, scale: float):
    """-> (out [B, T, Hq, D] in q's dtype, lse [B, T, Hq]) for the call's q rows in range order."""
    if len(call.pieces) == 1:
        p = call.pieces[0]
        return kernel.forward(q[:, p.q0 : p.q1], k[:, p.k0 : p.k1], v[:, p.k0 : p.k1], p.causal, scale, *_band(call))
    qr, kr = call.q_ranges, call.k_ranges
    o, lse = kernel.varlen_forward(
        take_rows(q, qr)[0], take_rows(k, kr)[0], take_rows(v, kr)[0], call.cu_q, call.cu_k, call.max_q,
        call.max_k, call.causal, scale,
    )
    return o.unsqueeze(0), lse.unsqueeze(0)


def call_backward(kernel: AttentionKernel, call: KernelCall, dout, q, k, v, out, lse, scale: float):
    """-> (dq [B, T, Hq, D], dk, dv [B, Tk, Hkv, D]) for the call's rows in range order, given the FINAL out/lse
    of those q rows (the ring's merged result: the softmax statistics of the whole row, not of this call)."""
    if len(call.pieces) == 1:
        p = call.pieces[0]
        sq, sk = slice(p.q0, p.q1), slice(p.k0, p.k1)
        return kernel.backward(dout[:, sq], q[:, sq], k[:, sk], v[:, sk], out[:, sq], lse[:, sq], p.causal, scale,
                               *_band(call))
    qr, kr = call.q_ranges, call.k_ranges
    g = kernel.varlen_backward(
        take_rows(dout, qr)[0], take_rows(q, qr)[0], take_rows(k, kr)[0], take_rows(v, kr)[0],
        take_rows(out, qr)[0], take_rows(lse, qr)[0], call.cu_q, call.cu_k, call.max_q, call.max_k, call.causal,
        scale,
    )
    return tuple(t.unsqueeze(0) for t in g)
