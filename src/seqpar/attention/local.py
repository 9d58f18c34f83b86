"""Local attention: the whole (KV) sequence is on this rank — a world of 1, or one Ulysses rank after its
exchange. No merge is ever needed: every q row is in exactly one piece (one document's diagonal, or the
whole row), so the kernel's outputs are written once, in the input dtype.

- No documents: ONE dense kernel call on the tensors as they are, its out/lse returned as the kernel gives
  them (no piece loop, no fp32 accumulator, no copy).
- Packed documents with a varlen kernel (CUDA flash, B == 1): ONE varlen call whose sequences are the
  documents; q/k/v/out are the local tensors themselves.
- Packed documents otherwise (the CPU kernel): one dense call per document.
- A sliding window: the banded pieces of attention.pieces, each q row still in exactly one call.
- Attention sinks: merged into the out / lse once every call has run (attention.sinks).
"""

from __future__ import annotations

import torch

from .calls import call_backward, call_forward, put_rows, varlen_ok, window_tile
from .kernels import AttentionKernel, acc_dtype
from .pieces import KernelCall, plan_calls, single_call
from .sinks import add_sink_, sink_grad

__all__ = ["local_calls", "local_forward", "local_backward", "local_attention"]


def local_calls(seq_len: int, causal: bool, bounds: list[int] | None, kernel: AttentionKernel,
                batch: int, window: int | None = None) -> tuple[KernelCall, ...] | None:
    """The kernel calls of a local attention over [0, seq_len), or None when some q row is in two of them
    (then it needs a merge: the ring path)."""
    calls = plan_calls([(0, seq_len)], [(0, seq_len)], causal, bounds, varlen_ok(kernel, batch), window,
                       window_tile(kernel, window))
    rows = sorted(r for c in calls for r in c.q_ranges)
    if any(a[1] > b[0] for a, b in zip(rows, rows[1:])):
        return None
    return calls


def local_forward(kernel: AttentionKernel, q, k, v, calls: tuple[KernelCall, ...], scale: float,
                  sinks: torch.Tensor | None = None):
    """-> (out [B, S, Hq, D] in q's dtype, lse [B, S, Hq]); `sinks` [Hq]: each head's sink logit (or None)."""
    out, lse = _calls_forward(kernel, q, k, v, calls, scale)
    if sinks is None:
        return out, lse
    acc = out.to(acc_dtype(q.dtype))
    lse = lse.to(acc.dtype)
    add_sink_(acc, lse, sinks)
    return acc.to(q.dtype), lse


def _calls_forward(kernel: AttentionKernel, q, k, v, calls: tuple[KernelCall, ...], scale: float):
    one = single_call(calls, q.shape[1], k.shape[1])
    if one is not None:
        return call_forward(kernel, one, q, k, v, scale)
    out, lse = q.new_zeros(q.shape), None
    for c in calls:
        o, l_ = call_forward(kernel, c, q, k, v, scale)
        if lse is None:
            lse = o.new_full(q.shape[:3], float("-inf"), dtype=l_.dtype)
        put_rows(out, o, c.q_ranges, add=False)
        put_rows(lse, l_, c.q_ranges, add=False)
        del o, l_  # not alive through the next call
    return out, lse


def local_backward(kernel: AttentionKernel, dout, q, k, v, out, lse, calls: tuple[KernelCall, ...], scale: float):
    """-> (dq, dk, dv) in the inputs' dtypes."""
    one = single_call(calls, q.shape[1], k.shape[1])
    if one is not None:
        return call_backward(kernel, one, dout, q, k, v, out, lse, scale)
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for c in calls:
        g = call_backward(kernel, c, dout, q, k, v, out, lse, scale)
        put_rows(dq, g[0], c.q_ranges, add=True)
        put_rows(dk, g[1], c.k_ranges, add=True)
        put_rows(dv, g[2], c.k_ranges, add=True)
        del g
    return dq, dk, dv


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel, calls, scale):
        out, lse = local_forward(kernel, q, k, v, calls, scale, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (kernel, calls, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        kernel, calls, scale = ctx.args
        dq, dk, dv = local_backward(kernel, dout, q, k, v, out, lse, calls, scale)
        ds = None
        if sinks is not None and ctx.needs_input_grad[3]:
            ds = sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq, dk, dv, ds, None, None, None


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: AttentionKernel,
                    calls: tuple[KernelCall, ...], scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable local attention (a world of 1): q [B, S, Hq, D], k/v [B, S, Hkv, D] -> [B, S, Hq, D];
    `sinks` [Hq] (differentiable) or None."""
    return _LocalAttention.apply(q, k, v, sinks, kernel, calls, scale)
