"""Ulysses with one fused all-to-all per direction, written straight into the layout the kernel reads.

q, k and v (after the head plan) are packed into ONE send buffer [P, B, S/P, hq+2hk, D] (rank i's slot
holds its heads of all three) and exchanged with one all-to-all; the received buffer IS the kernel's
[B, S, hq+2hk, D] input for B == 1 (a view; one block copy for B > 1) and the kernel reads q/k/v as
views of it. The kernel's output comes back sequence-major, so its send buffer is a view for B == 1;
one copy puts the received pieces into [B, S/P, Hq, D]. Backward mirrors it: dout in one all-to-all,
dq/dk/dv packed into one buffer (one copy) and back in one. A pure-Ulysses call issues 2 collectives
forward and 2 backward (before, and DeepSpeed: 4 + 4).

`chunks` > 1 splits the local kv heads (and their q groups) into that many groups, exchanged as
separate all-to-alls, all posted at once (async): chunk c's kernel runs while chunks c+1.. are in
flight, and chunk c's output travels while chunk c+1 computes. On gloo the collectives run on gloo's
own threads; on NCCL on its communication stream (work.wait() orders the compute stream after it).
Every chunk is an exact slice of the heads, so the result is the same for any `chunks`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from .kernels import AttentionKernel
from .ring import plan_pieces

__all__ = ["exchange_qkv", "fused_ulysses_attention", "local_pieces_disjoint"]


def _heads(t: torch.Tensor, p: int, lo: int, w: int) -> torch.Tensor:
    """Sequence shard [B, s, P*hl, D] -> view [B, s, P, w, D] of heads lo..lo+w inside each rank's slot."""
    b, s, h, d = t.shape
    return t.view(b, s, p, h // p, d)[:, :, :, lo : lo + w]


def _pack_seq_shard(parts: list[torch.Tensor]) -> torch.Tensor:
    """[B, s, P, w_i, D] views -> one contiguous [P, B, s, sum w_i, D] send buffer (one copy)."""
    b, s, p, _, d = parts[0].shape
    buf = parts[0].new_empty(p, b, s, sum(t.shape[3] for t in parts), d)
    off = 0
    for t in parts:
        buf[:, :, :, off : off + t.shape[3]].copy_(t.permute(2, 0, 1, 3, 4))
        off += t.shape[3]
    return buf


def _pack_full_seq(parts: list[torch.Tensor], p: int) -> torch.Tensor:
    """[B, P*s, w, D] head shards (any strides) -> contiguous [P, B, s, w, D] send buffer (one copy)."""
    b, n, _, d = parts[0].shape
    views = [t.reshape(b, p, n // p, t.shape[2], d).transpose(0, 1) for t in parts]
    if len(views) == 1:
        return views[0].contiguous()
    return torch.cat(views, dim=3)


def _as_full_seq(recv: torch.Tensor) -> torch.Tensor:
    """[P, B, s, h, D] receive buffer -> [B, P*s, h, D] in sequence-major memory, the layout the kernel reads.

    B == 1 (packed rows, the long-context case): a free view, no copy. B > 1: one copy of whole [s, h, D]
    blocks. (A heads-major copy, tried before, cost ~9x DeepSpeed's copies and the CPU flash kernel ran no
    faster on it; the kernels' outputs and gradients come back sequence-major too.)"""
    p, b, s, h, d = recv.shape
    if b == 1:
        return recv.view(1, p * s, h, d)
    return recv.transpose(0, 1).reshape(b, p * s, h, d)


def _unpack_into(out: torch.Tensor, recv: torch.Tensor, lo: int) -> None:
    """[P, B, s, w, D] receive buffer -> heads lo..lo+w of every rank's slot of out [B, s, P*hl, D]."""
    p, b, s, w, d = recv.shape
    out.view(b, s, p, -1, d)[:, :, :, lo : lo + w].copy_(recv.permute(1, 2, 0, 3, 4))


def local_pieces_disjoint(seq_len: int, causal: bool, bounds: list[int] | None):
    """The local (ring size 1) pieces, or None when some q row is in two of them (then it needs a merge)."""
    pieces = plan_pieces([(0, seq_len)], [(0, seq_len)], causal, bounds)
    rows = sorted((p.q0, p.q1) for p in pieces)
    if any(a[1] > b[0] for a, b in zip(rows, rows[1:])):
        return None
    return pieces


def _whole(pieces, n: int) -> bool:
    """One piece covering the whole sequence (no packed documents): one kernel call, no copies."""
    return len(pieces) == 1 and (pieces[0].q0, pieces[0].q1, pieces[0].k0, pieces[0].k1) == (0, n, 0, n)


def _kernel_fwd(kernel: AttentionKernel, q, k, v, pieces, scale):
    if _whole(pieces, q.shape[1]):
        return kernel.forward(q, k, v, pieces[0].causal, scale)
    out = q.new_zeros(q.shape)
    lse = None
    for pc in pieces:
        o, l_ = kernel.forward(q[:, pc.q0 : pc.q1], k[:, pc.k0 : pc.k1], v[:, pc.k0 : pc.k1], pc.causal, scale)
        if lse is None:
            lse = o.new_full(q.shape[:3], float("-inf"), dtype=l_.dtype)
        out[:, pc.q0 : pc.q1] = o
        lse[:, pc.q0 : pc.q1] = l_
    return out, lse


def _kernel_bwd(kernel: AttentionKernel, dout, q, k, v, out, lse, pieces, scale):
    if _whole(pieces, q.shape[1]):
        return kernel.backward(dout, q, k, v, out, lse, pieces[0].causal, scale)
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for pc in pieces:
        sq, sk = slice(pc.q0, pc.q1), slice(pc.k0, pc.k1)
        g = kernel.backward(dout[:, sq], q[:, sq], k[:, sk], v[:, sk], out[:, sq], lse[:, sq], pc.causal, scale)
        dq[:, sq] += g[0]
        dk[:, sk] += g[1]
        dv[:, sk] += g[2]
    return dq, dk, dv


def _chunk_heads(hq: int, hk: int, chunks: int) -> list[tuple[int, int, int, int]]:
    """(q lo, q width, kv lo, kv width) per chunk of the local heads: whole kv groups per chunk (GQA)."""
    g = hq // hk
    per = hk // chunks
    return [(c * per * g, per * g, c * per, per) for c in range(chunks)]


class _ExchangeQKV(torch.autograd.Function):
    """q, k, v sequence shards -> head shards in ONE all-to-all (and dq, dk, dv back in one)."""

    @staticmethod
    def forward(ctx, q, k, v, group, stats, device):
        p = comm.group_size(group)
        hq, hk = q.shape[2] // p, k.shape[2] // p
        buf = _pack_seq_shard([_heads(q, p, 0, hq), _heads(k, p, 0, hk), _heads(v, p, 0, hk)])
        x = _as_full_seq(comm.all_to_all_buffer(buf, group, stats, "ulysses_fwd", device)[0])
        ctx.args = (group, stats, device, hq, hk, q.shape, k.shape)
        return x[:, :, :hq], x[:, :, hq : hq + hk], x[:, :, hq + hk :]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        group, stats, device, hq, hk, q_shape, kv_shape = ctx.args
        p = comm.group_size(group)
        like = next(t for t in (dq, dk, dv) if t is not None)
        b, n, _, d = like.shape
        grads = [g if g is not None else like.new_zeros(b, n, h, d) for g, h in ((dq, hq), (dk, hk), (dv, hk))]
        recv = comm.all_to_all_buffer(_pack_full_seq(grads, p), group, stats, "ulysses_bwd", device)[0]
        out = [like.new_empty(q_shape), like.new_empty(kv_shape), like.new_empty(kv_shape)]
        _unpack_into(out[0], recv[..., :hq, :], 0)
        _unpack_into(out[1], recv[..., hq : hq + hk, :], 0)
        _unpack_into(out[2], recv[..., hq + hk :, :], 0)
        return *out, None, None, None


def exchange_qkv(q, k, v, group, stats=None, device=None):
    """Differentiable fused seq->heads exchange of q [B, s, Hq', D] and k/v [B, s, Hkv', D] (one all-to-all)."""
    return _ExchangeQKV.apply(q, k, v, group, stats, device)


class _FusedUlysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, stats, device, causal, scale, kernel, pieces, chunks):
        p = comm.group_size(group)
        plan = _chunk_heads(q.shape[2] // p, k.shape[2] // p, chunks)
        sends = []
        for q0, qw, k0, kw in plan:  # pack and post every chunk's exchange before any compute
            buf = _pack_seq_shard([_heads(q, p, q0, qw), _heads(k, p, k0, kw), _heads(v, p, k0, kw)])
            sends.append(comm.all_to_all_buffer(buf, group, stats, "ulysses_fwd", device, async_op=True))
        backs, saved = [], []
        for c, (_, qw, _, kw) in enumerate(plan):
            recv, work = sends[c]
            work.wait()
            x = _as_full_seq(recv)
            sends[c] = recv = work = None  # free the exchange buffers before the kernel runs (peak memory)
            qh, kh, vh = x[:, :, :qw], x[:, :, qw : qw + kw], x[:, :, qw + kw :]
            oh, lse = _kernel_fwd(kernel, qh, kh, vh, pieces, scale)
            oh = oh.to(q.dtype)
            back = _pack_full_seq([oh], p)  # chunk c's output travels while chunk c+1 computes
            backs.append(comm.all_to_all_buffer(back, group, stats, "ulysses_fwd", device, async_op=True))
            saved += [x, oh, lse]
        out = q.new_empty(q.shape)
        for c, (q0, _, _, _) in enumerate(plan):
            recv, work = backs[c]
            work.wait()
            _unpack_into(out, recv, q0)
            backs[c] = recv = work = None
        ctx.save_for_backward(*saved)
        ctx.args = (group, stats, device, scale, kernel, pieces, plan, k.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        group, stats, device, scale, kernel, pieces, plan, kv_shape = ctx.args
        p = comm.group_size(group)
        saved = ctx.saved_tensors
        dout = dout.to(saved[1].dtype)
        douts = []
        for q0, qw, _, _ in plan:
            buf = _pack_seq_shard([_heads(dout, p, q0, qw)])
            douts.append(comm.all_to_all_buffer(buf, group, stats, "ulysses_bwd", device, async_op=True))
        backs = []
        for c, (_, qw, _, kw) in enumerate(plan):
            recv, work = douts[c]
            work.wait()
            douts[c] = work = None
            x, oh, lse = saved[3 * c : 3 * c + 3]
            qh, kh, vh = x[:, :, :qw], x[:, :, qw : qw + kw], x[:, :, qw + kw :]
            g = _kernel_bwd(kernel, _as_full_seq(recv), qh, kh, vh, oh, lse, pieces, scale)
            recv = None
            send = _pack_full_seq([t.to(oh.dtype) for t in g], p)
            backs.append(comm.all_to_all_buffer(send, group, stats, "ulysses_bwd", device, async_op=True))
        dq, dk, dv = dout.new_empty(dout.shape), dout.new_empty(kv_shape), dout.new_empty(kv_shape)
        for c, (q0, qw, k0, kw) in enumerate(plan):
            recv, work = backs[c]
            work.wait()
            _unpack_into(dq, recv[..., :qw, :], q0)
            _unpack_into(dk, recv[..., qw : qw + kw, :], k0)
            _unpack_into(dv, recv[..., qw + kw :, :], k0)
            backs[c] = recv = work = None
        return dq, dk, dv, *(None,) * 8


def fused_ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    pieces: list,
    stats: comm.CommStats | None = None,
    device: torch.device | None = None,
    chunks: int = 1,
) -> torch.Tensor:
    """Pure Ulysses on plan-padded q [B, s, Hq', D], k/v [B, s, Hkv', D] (Hkv' % P == 0) -> out [B, s, Hq', D].

    `pieces`: the local piece plan from `local_pieces_disjoint` (no q row in two pieces). `chunks` must
    divide the local kv heads Hkv'/P (checked by the caller before any collective)."""
    return _FusedUlysses.apply(q, k, v, group, stats, device, causal, scale, kernel, pieces, chunks)
