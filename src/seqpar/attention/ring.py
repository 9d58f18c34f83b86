"""Ring attention over the ring group: Q stays, K/V blocks travel r -> r+1.

Each ring rank holds a list of global segments (layout.ring_segments). For every (Q, KV-block)
pair the work is planned as "pieces": maximal (q range, kv range) rectangles of one document that
are either fully visible (non-causal) or an exact causal diagonal. With grid-aligned segments
(contiguous or zigzag chunks) no other case exists, so no masked kernel call and no fully-masked
row ever happens, and zigzag's off-diagonal steps are exactly half blocks.

The same code with ring size 1 is the local attention for Ulysses (per-document varlen pieces).
Forward merges (out, lse) per piece in fp32 (fp64 for fp64 inputs). Backward reruns the ring and
calls the kernel backward per piece with the FINAL out/lse; dQ accumulates locally. dK/dV are reduced
in R-1 hops (the reduce-scatter bound): each rank keeps its own block's gradient, and the partial sum
of block j starts at ring rank j+1, follows the KV ring and ends at j, where the own part is added.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..comm import CommStats, RingComm
from ..layout import Segment
from .kernels import AttentionKernel, acc_dtype
from .merge import merge_

__all__ = ["Piece", "plan_pieces", "ring_attention"]


@dataclass(frozen=True)
class Piece:
    q0: int  # local q offsets [q0, q1)
    q1: int
    k0: int  # local kv offsets [k0, k1) within the KV block
    k1: int
    causal: bool


def _with_offsets(segs: list[Segment]) -> list[tuple[int, int, int]]:
    out, off = [], 0
    for g, n in segs:
        out.append((g, n, off))
        off += n
    return out


def _doc_ranges(lo: int, hi: int, bounds: list[int] | None) -> list[tuple[int, int]]:
    """Split global [lo, hi) at document boundaries."""
    if not bounds:
        return [(lo, hi)]
    cuts = [lo] + [b for b in bounds if lo < b < hi] + [hi]
    return list(zip(cuts[:-1], cuts[1:]))


def _doc_id(pos: int, bounds: list[int] | None) -> int:
    return bisect.bisect_right(bounds, pos) if bounds else 0


def plan_pieces(
    q_segs: list[Segment], kv_segs: list[Segment], causal: bool, bounds: list[int] | None = None
) -> list[Piece]:
    """Pieces of work between a Q block and a KV block (both given as global segments).

    `bounds` are the inner document boundaries (cu_seqlens without its first and last entry).
    """
    pieces: list[Piece] = []
    for gq, nq, oq in _with_offsets(q_segs):
        for qa, qb in _doc_ranges(gq, gq + nq, bounds):
            doc = _doc_id(qa, bounds)
            for gk, nk, ok in _with_offsets(kv_segs):
                for da, db in _doc_ranges(gk, gk + nk, bounds):
                    if _doc_id(da, bounds) != doc:
                        continue
                    p = _classify(qa, qb, da, db, causal)
                    if p is None:
                        continue
                    pieces.append(Piece(qa - gq + oq, qb - gq + oq, da - gk + ok, db - gk + ok, p))
    return _merge_pieces(pieces)


def _classify(qa: int, qb: int, ka: int, kb: int, causal: bool) -> bool | None:
    """None: no interaction; False: fully visible; True: causal diagonal (identical ranges)."""
    if not causal:
        return False
    if (qa, qb) == (ka, kb):
        return True
    if kb - 1 <= qa:
        return False
    if ka > qb - 1:
        return None
    raise AssertionError(f"segments not grid-aligned: q [{qa},{qb}) vs kv [{ka},{kb})")


def _merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Fuse fully-visible pieces that share a q range and touch in kv, then those sharing a kv range
    and touching in q (e.g. zigzag's off-diagonal half blocks become one kernel call)."""

    def fuse(items: list[Piece], same, touch, join) -> list[Piece]:
        out: list[Piece] = []
        for p in items:
            last = out[-1] if out else None
            if last is not None and not last.causal and not p.causal and same(last, p) and touch(last, p):
                out[-1] = join(last, p)
            else:
                out.append(p)
        return out

    pieces = fuse(
        sorted(pieces, key=lambda p: (p.q0, p.q1, p.k0)),
        lambda a, b: (a.q0, a.q1) == (b.q0, b.q1),
        lambda a, b: a.k1 == b.k0,
        lambda a, b: Piece(a.q0, a.q1, a.k0, b.k1, False),
    )
    return fuse(
        sorted(pieces, key=lambda p: (p.k0, p.k1, p.q0)),
        lambda a, b: (a.k0, a.k1) == (b.k0, b.k1),
        lambda a, b: a.q1 == b.q0,
        lambda a, b: Piece(a.q0, b.q1, a.k0, a.k1, False),
    )


def piece_flops(pieces: list[Piece], batch: int, heads: int, head_dim: int) -> float:
    """Forward matmul FLOPs of a list of pieces (causal pieces count half)."""
    total = 0.0
    for p in pieces:
        area = (p.q1 - p.q0) * (p.k1 - p.k0)
        if p.causal:
            n = p.q1 - p.q0
            area = n * (n + 1) / 2
        total += 4.0 * batch * heads * head_dim * area
    return total


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
    def forward(ctx, q, k, v, group, stats, all_segs, ring_rank, bounds, causal, scale, kernel, device):
        ring = RingComm(group, stats, "ring_fwd", device=device)
        r, n = ring_rank, ring.size
        a = acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=a, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=a, device=q.device)
        untouched = [(0, q.shape[1])]  # local q rows no piece has written yet
        kk, vv = k, v
        for step in range(n):
            if step < n - 1:
                ring.start([kk, vv])  # next block's transfer overlaps this block's compute
            j = (r - step) % n
            for p in plan_pieces(all_segs[r], all_segs[j], causal, bounds):
                o_p, l_p = kernel.forward(q[:, p.q0 : p.q1], kk[:, p.k0 : p.k1], vv[:, p.k0 : p.k1], p.causal, scale)
                if any(a0 <= p.q0 and p.q1 <= a1 for a0, a1 in untouched):
                    # First result for all these rows: a copy, not a merge into an empty accumulator.
                    out[:, p.q0 : p.q1] = o_p
                    lse[:, p.q0 : p.q1] = l_p
                else:
                    merge_(out[:, p.q0 : p.q1], lse[:, p.q0 : p.q1], o_p, l_p)
                untouched = _remove_range(untouched, p.q0, p.q1)
                del o_p, l_p
            if step < n - 1:
                kk, vv = ring.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, stats, all_segs, ring_rank, bounds, causal, scale, kernel, device)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, stats, all_segs, r, bounds, causal, scale, kernel, device = ctx.args
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
            dkv = _block_grads(kernel, plan_pieces(all_segs[r], all_segs[j], causal, bounds), dout, q, kk, vv, out,
                               lse, scale, dq)
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
        none = (None,) * 9
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *none)


def _block_grads(kernel: AttentionKernel, pieces: list[Piece], dout: torch.Tensor, q: torch.Tensor,
                 kk: torch.Tensor, vv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
                 dq: torch.Tensor) -> torch.Tensor:
    """One KV block's backward: dQ accumulates into dq; returns the block's [dK; dV] stacked in one
    accumulator-dtype buffer (one message per ring hop, not two). Each piece's kernel outputs are freed
    once added (they would otherwise stay alive through the sends)."""
    dkv = torch.zeros((2, *kk.shape), dtype=dq.dtype, device=kk.device)
    dk, dv = dkv[0], dkv[1]
    for p in pieces:
        sq, sk = slice(p.q0, p.q1), slice(p.k0, p.k1)
        g_q, g_k, g_v = kernel.backward(dout[:, sq], q[:, sq], kk[:, sk], vv[:, sk], out[:, sq], lse[:, sq], p.causal,
                                        scale)
        dq[:, sq] += g_q
        dk[:, sk] += g_k
        dv[:, sk] += g_v
        del g_q, g_k, g_v  # else they stay alive through the next piece's kernel call
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
) -> torch.Tensor:
    """Attention of local q against the KV of every ring rank. all_segs[j] = ring rank j's segments.
    `device`: the mesh's communication device (seqpar.comm's device rule)."""
    return _RingAttention.apply(q, k, v, group, stats, all_segs, ring_rank, bounds, causal, scale, kernel, device)
