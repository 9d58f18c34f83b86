"""Ring attention over the ring group: Q stays, K/V blocks travel r -> r+1.

Each ring rank holds a list of global segments (layout.ring_segments). For every (Q, KV-block) pair the
work is planned by `pieces.plan_calls`: the pieces (one document's fully visible rectangle or exact causal
diagonal) and the kernel calls that run them (one varlen call per causal flag where the kernel has that
form, else one call per piece). Forward merges each call's (out, lse) per q range in fp32 (fp64 for fp64
inputs). Backward reruns the ring and calls the kernel backward per call with the FINAL out/lse; dQ
accumulates locally. dK/dV are reduced in R-1 hops (the reduce-scatter bound): each rank keeps its own
block's gradient, and the partial sum of block j starts at ring rank j+1, follows the KV ring and ends at j,
where the own part is added. A world of 1 never comes here (attention.local: no merge, no fp32 copy).
A sliding window is part of the plan (pieces.plan_calls): a step whose KV block no local query can reach has no
call and computes nothing (its block still passes through). Attention sinks start each row's accumulator at
(0, sink) instead of empty (attention.sinks); the backward adds this rank's rows' part of their gradient.
"""

from __future__ import annotations

import torch

from ..comm import CommStats, RingComm
from ..layout import Segment
from .calls import call_backward, call_forward, put_rows, varlen_ok, window_tile
from .kernels import AttentionKernel, acc_dtype
from .merge import merge_
from .pieces import KernelCall, Piece, piece_flops, plan_calls, plan_pieces
from .sinks import sink_grad

__all__ = ["Piece", "plan_pieces", "piece_flops", "block_forward", "block_backward", "ring_attention"]


def _remove_range(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    out = []
    for a, b in ranges:
        if b <= lo or a >= hi:
            out.append((a, b))
        else:
            if a < lo:
                out.append((a, lo))
            if hi < b:
                out.append((hi, b))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, stats, all_segs, ring_rank, bounds, causal, scale, kernel, device,
                window):
        ring = RingComm(group, stats, "ring_fwd", device=device)
        r, n = ring_rank, ring.size
        a = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=a, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=a, device=q.device)
        untouched = [(0, q.shape[1])]  # local q rows no piece has written yet
        if sinks is not None:  # every row starts at (0, sink): each block merges into it
            lse.copy_(sinks.to(a).expand(lse.shape))
            untouched = []
        tile = window_tile(kernel, window)
        kk, vv = k, v
        for step in range(n):
            if step < n - 1:
                ring.start([kk, vv])  # next block's transfer overlaps this block's compute
            j = (r - step) % n
            calls = plan_calls(all_segs[r], all_segs[j], causal, bounds, varlen_ok(kernel, q.shape[0]), window, tile)
            untouched = block_forward(kernel, calls, q, kk, vv, scale, out, lse, untouched)
            if step < n - 1:
                kk, vv = ring.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (group, stats, all_segs, ring_rank, bounds, causal, scale, kernel, device, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, stats, all_segs, r, bounds, causal, scale, kernel, device, window = ctx.args
        tile = window_tile(kernel, window)
        kv_ring = RingComm(group, stats, "ring_bwd", tag=0, device=device)
        dkv_ring = RingComm(group, stats, "ring_bwd", tag=1, device=device)
        n = kv_ring.size
        a = acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=a, device=q.device)
        kk, vv = k, v
        dkv_own = None
        for step in range(n):
            if step < n - 1:
                kv_ring.start([kk, vv])
            j = (r - step) % n
            calls = plan_calls(all_segs[r], all_segs[j], causal, bounds, varlen_ok(kernel, q.shape[0]), window, tile)
            dkv = block_backward(kernel, calls, dout, q, kk, vv, out, lse, scale, dq)
            if step == 0:
                dkv_own = dkv  # own block: stays here, its partial sum comes home last
            else:
                if step > 1:
                    _add_received(dkv, dkv_ring)  # block j's partial sum from ring ranks j+1 .. r-1
                dkv_ring.start([dkv])  # n-1 sends in all: the reduce-scatter bound
            del dkv  # (a block in flight is held by its send until the next wait)
            if step < n - 1:
                kk, vv = kv_ring.wait()
        del kk, vv
        if n > 1:
            _add_received(dkv_own, dkv_ring)  # own block's sum over ring ranks r+1 .. r-1 (all others)
        dk, dv = dkv_own[0], dkv_own[1]
        ds = None
        if sinks is not None and ctx.needs_input_grad[3]:
            ds = sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        none = (None,) * 10
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), ds, *none)


def block_forward(kernel: AttentionKernel, calls: tuple[KernelCall, ...], q: torch.Tensor, kk: torch.Tensor,
                  vv: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor,
                  untouched: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """One KV block's forward: each call's (out, lse) merged into the accumulators per q range (a copy where no
    earlier result exists: `untouched`, the rows nothing has written yet; returned updated)."""
    for call in calls:
        o_c, l_c = call_forward(kernel, call, q, kk, vv, scale)
        t = 0
        for a0, a1 in call.q_ranges:
            o_p, l_p = o_c[:, t : t + a1 - a0], l_c[:, t : t + a1 - a0]
            if any(u0 <= a0 and a1 <= u1 for u0, u1 in untouched):
                out[:, a0:a1] = o_p  # first result for all these rows: a copy, not a merge into an empty one
                lse[:, a0:a1] = l_p
            else:
                merge_(out[:, a0:a1], lse[:, a0:a1], o_p, l_p)
            untouched = _remove_range(untouched, a0, a1)
            t += a1 - a0
        del o_c, l_c, o_p, l_p  # not alive through the next call's kernel
    return untouched


def block_backward(kernel: AttentionKernel, calls: tuple[KernelCall, ...], dout: torch.Tensor, q: torch.Tensor,
                 kk: torch.Tensor, vv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                 dq: torch.Tensor) -> torch.Tensor:
    """One KV block's backward: dQ accumulates into dq; returns the block's [dK; dV] stacked in one
    accumulator-dtype buffer (one message per ring hop, not two). Each call's kernel outputs are freed
    once added (they would otherwise stay alive through the sends)."""
    dkv = torch.zeros((2, *kk.shape), dtype=dq.dtype, device=kk.device)
    for call in calls:
        g_q, g_k, g_v = call_backward(kernel, call, dout, q, kk, vv, out, lse, scale)
        put_rows(dq, g_q, call.q_ranges, add=True)
        put_rows(dkv[0], g_k, call.k_ranges, add=True)
        put_rows(dkv[1], g_v, call.k_ranges, add=True)
        del g_q, g_k, g_v  # else they stay alive through the next call's kernel
    return dkv


def _add_received(acc: torch.Tensor, ring: RingComm) -> None:
    """acc += the partial sum the ring delivers (the receive buffer is freed on return)."""
    (got,) = ring.wait()
    acc += got


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    all_segs: list[list[Segment]],
    ring_rank: int,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    bounds: list[int] | None = None,
    stats: CommStats | None = None,
    device: torch.device | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of local q against the KV of every ring rank. all_segs[j] = ring rank j's segments.
    `device`: the mesh's communication device (seqpar.comm's device rule). `window`: a causal sliding window of
    that many tokens; `sinks` [Hq]: each local head's sink logit (differentiable), or None."""
    return _RingAttention.apply(q, k, v, sinks, group, stats, all_segs, ring_rank, bounds, causal, scale, kernel,
                                device, window)
