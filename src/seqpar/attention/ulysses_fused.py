"""Ulysses with one fused all-to-all per direction, written straight into the layout the kernel reads.

q, k and v (after the head plan) are packed into ONE send buffer [P, B, S/P, hq+2hk, D] (rank i's slot
holds its heads of all three) and exchanged with one all-to-all; the received buffer x IS the kernel's
[B, S, hq+2hk, D] input for B == 1 (a view; one block copy for B > 1) and the kernel reads q/k/v as
views of it. The kernel's output comes back sequence-major, so its send buffer is a view for B == 1;
one copy puts the received pieces into [B, S/P, Hq, D]. Backward mirrors it: dout in one all-to-all,
dq/dk/dv back in one. A pure-Ulysses call issues 2 collectives forward and 2 backward (DeepSpeed's and
yunchang's: 4 + 4).

Backward memory (docs/attention.md, "Ulysses' bytes", counts it tensor by tensor): the kernel runs one kv head
(and its q group) at a time and each group's dq, dk, dv are written over that group's q, k, v in x, which then
IS the gradient exchange's send buffer (B == 1: no packing copy); the saved output and lse are freed before the
exchange, x once it has been sent, before dq, dk, dv are allocated. All of that only when autograd drops the graph
after this backward (no retain_graph / create_graph): otherwise the saved tensors stay intact and the gradients
get a buffer of their own. Storage is freed with `untyped_storage().resize_(0)` (what FSDP does with gathered
parameters; torch's MemTracker counts it): these buffers are this function's own, never seen by a caller.

`chunks` > 1 splits the local kv heads (and their q groups) into that many groups, exchanged as
separate all-to-alls, all posted at once (async): chunk c's kernel runs while chunks c+1.. are in
flight, and chunk c's output travels while chunk c+1 computes. On gloo the collectives run on gloo's
own threads; on NCCL on its communication stream (work.wait() orders the compute stream after it).
Every chunk is an exact slice of the heads, so the result is the same for any `chunks`.
Attention sinks (one logit per original q head) follow the heads: each rank merges the sinks of the heads it
holds into its kernel's result and returns their gradient (attention.sinks).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from .. import comm
from .kernels import AttentionKernel
from .local import local_backward, local_forward
from .sinks import heads_grad_to_sinks, sink_grad, sinks_for_heads
from .ulysses import HeadPlan, RankHeads, rank_heads

__all__ = ["from_rank_heads", "fused_ulysses_attention", "to_rank_heads"]


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


def _scatter_qkv(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, blocks: list[torch.Tensor],
                 ranks: list[RankHeads], replicated: bool) -> None:
    """Every rank's [B, s, q + 2 kv heads, D] gradient block into dq, dk, dv (sequence shards, original heads);
    a kv head replicated on several ranks gets the sum of their gradients."""
    for r, blk in zip(ranks, blocks):
        nq, nk = len(r.q), len(r.kv)
        _scatter(dq, blk[:, :, :nq], r.q, add=False)
        _scatter(dk, blk[:, :, nq : nq + nk], r.kv, add=replicated)
        _scatter(dv, blk[:, :, nq + nk :], r.kv, add=replicated)


def _grad_buffers(like: torch.Tensor, q_shape, kv_shape, ranks: list[RankHeads]):
    """dq (every q head is written once) and dk, dv (zeros when some kv head is replicated: its parts add up)."""
    replicated = sum(len(r.kv) for r in ranks) > kv_shape[2]
    dq = like.new_empty(q_shape)
    dk, dv = (like.new_zeros(kv_shape) if replicated else like.new_empty(kv_shape) for _ in range(2))
    return dq, dk, dv, replicated


class _ToHeads(torch.autograd.Function):
    """USP: original q, k, v sequence shards -> this rank's `rank_heads` over the Ulysses group's whole
    sequence [B, P*s, h, D], in ONE uneven all-to-all (no padded copies); dq, dk, dv back in one."""

    @staticmethod
    def forward(ctx, q, k, v, group, stats, device, ranks):
        p, me = comm.group_size(group), comm.group_rank(group)
        b, s, _, d = q.shape
        recv, _ = _to_ranks([(q, "q"), (k, "kv"), (v, "kv")], ranks, group, stats, "ulysses_fwd", device)
        x = _even_recv(recv, p, b, s, d)
        nq, nk = len(ranks[me].q), len(ranks[me].kv)
        ctx.args = (group, stats, device, ranks, q.shape, k.shape)
        return x[:, :, :nq], x[:, :, nq : nq + nk], x[:, :, nq + nk :]

    @staticmethod
    def backward(ctx, dqh, dkh, dvh):
        group, stats, device, ranks, q_shape, kv_shape = ctx.args
        p, me = comm.group_size(group), comm.group_rank(group)
        like = next(t for t in (dqh, dkh, dvh) if t is not None)
        b, n, _, d = like.shape
        nq, nk = len(ranks[me].q), len(ranks[me].kv)
        grads = [g if g is not None else like.new_zeros(b, n, h, d) for g, h in ((dqh, nq), (dkh, nk), (dvh, nk))]
        send = _pack_full_seq(grads, p).view(-1)
        recv, _, sizes = _back_to_seq(send, [r.width for r in ranks], b * (n // p) * d, group, stats, "ulysses_bwd",
                                      device)
        dq, dk, dv, replicated = _grad_buffers(like, q_shape, kv_shape, ranks)
        _scatter_qkv(dq, dk, dv, _blocks(recv, sizes, b, n // p, d), ranks, replicated)
        return dq, dk, dv, None, None, None, None


class _FromHeads(torch.autograd.Function):
    """USP: this rank's attention output [B, P*s, h, D] on its `rank_heads` -> the sequence shard [B, s, Hq, D]
    (original heads, dummies dropped) in one uneven all-to-all; the gradient back in one."""

    @staticmethod
    def forward(ctx, oh, group, stats, device, ranks, q_shape):
        p = comm.group_size(group)
        b, s, _, d = q_shape
        send = _pack_full_seq([oh], p).view(-1)
        recv, _, sizes = _back_to_seq(send, [len(r.q) for r in ranks], b * s * d, group, stats, "ulysses_fwd", device)
        out = oh.new_empty(q_shape)
        for r, blk in zip(ranks, _blocks(recv, sizes, b, s, d)):
            _scatter(out, blk, r.q, add=False)
        ctx.args = (group, stats, device, ranks)
        return out

    @staticmethod
    def backward(ctx, dout):
        group, stats, device, ranks = ctx.args
        b, s, _, d = dout.shape
        recv, _ = _to_ranks([(dout, "q")], ranks, group, stats, "ulysses_bwd", device)
        return _even_recv(recv, comm.group_size(group), b, s, d), None, None, None, None, None


def to_rank_heads(q, k, v, group, plan: HeadPlan, stats=None, device=None):
    """Differentiable: original q [B, s, Hq, D], k/v [B, s, Hkv, D] -> this rank's (q, k, v) head shards of the
    Ulysses group's sequence, as `rank_heads(plan)` places them (USP: the same layout on every ring rank)."""
    return _ToHeads.apply(q, k, v, group, stats, device, rank_heads(plan))


def from_rank_heads(oh, group, plan: HeadPlan, q_shape, stats=None, device=None):
    """Differentiable inverse for the attention output: [B, P*s, h, D] head shard -> [B, s, Hq, D]."""
    return _FromHeads.apply(oh, group, stats, device, rank_heads(plan), tuple(q_shape))


@lru_cache(maxsize=1024)
def _runs(idx: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(position, source head, length) of the runs of consecutive heads in idx; source -1: a dummy run.
    Cached: the same few head sets recur in every layer's forward and backward."""
    runs: list[list[int]] = []
    for j, h in enumerate(idx):
        r = runs[-1] if runs else None
        if r and ((h < 0 and r[1] < 0) or (h >= 0 and r[1] >= 0 and h == r[1] + r[2])):
            r[2] += 1
        else:
            runs.append([j, h, 1])
    return tuple((j, h, n) for j, h, n in runs)


def _gather(dst: torch.Tensor, src: torch.Tensor, idx: tuple[int, ...]) -> None:
    """dst[:, :, j] = src[:, :, idx[j]] (zeros for -1), copied in runs of consecutive heads."""
    for j, h, n in _runs(idx):
        if h < 0:
            dst[:, :, j : j + n].zero_()
        else:
            dst[:, :, j : j + n].copy_(src[:, :, h : h + n])


def _scatter(dst: torch.Tensor, src: torch.Tensor, idx: tuple[int, ...], add: bool) -> None:
    """dst[:, :, idx[j]] = (or +=) src[:, :, j], skipping -1 (dummies), in runs of consecutive heads."""
    for j, h, n in _runs(idx):
        if h >= 0:
            (dst[:, :, h : h + n].add_ if add else dst[:, :, h : h + n].copy_)(src[:, :, j : j + n])


def _pack_to_ranks(parts: list[tuple[torch.Tensor, str]], ranks: list[RankHeads]) -> tuple[torch.Tensor, list[int]]:
    """Sequence shards -> one flat send buffer: rank i's block [B, s, heads of rank i, D] holds, for each
    (tensor, 'q' | 'kv') in parts, the heads rank i gets. Returns (buffer, elements per rank)."""
    b, s, _, d = parts[0][0].shape
    widths = [sum(len(r.q if kind == "q" else r.kv) for _, kind in parts) for r in ranks]
    sizes = [b * s * w * d for w in widths]
    buf = parts[0][0].new_empty(sum(sizes))
    for r, w, off in zip(ranks, widths, _offsets(sizes)):
        blk, lo = buf[off : off + b * s * w * d].view(b, s, w, d), 0
        for t, kind in parts:
            idx = r.q if kind == "q" else r.kv
            _gather(blk[:, :, lo : lo + len(idx)], t, idx)
            lo += len(idx)
    return buf, sizes


def _to_ranks(parts: list[tuple[torch.Tensor, str]], ranks: list[RankHeads], group: Any, stats, channel: str,
              device, async_op: bool = False) -> tuple[torch.Tensor, Any]:
    """Sequence shards -> every rank its heads (`_pack_to_ranks`) in one uneven all-to-all; this rank receives
    an equal piece (its own heads of each rank's shard) from every rank. Returns (receive buffer, work)."""
    buf, sizes = _pack_to_ranks(parts, ranks)
    mine = [sizes[comm.group_rank(group)]] * comm.group_size(group)
    return comm.all_to_all_split(buf, sizes, mine, group, stats, channel, device, async_op=async_op)


def _back_to_seq(send: torch.Tensor, widths: list[int], per_head: int, group: Any, stats, channel: str, device,
                 async_op: bool = False) -> tuple[torch.Tensor, Any, list[int]]:
    """This rank's heads of every rank's shard (a flat `_pack_full_seq` buffer, equal pieces) -> each rank's
    sequence shard of them; rank i holds widths[i] heads of `per_head` elements (B * s * D) each.
    Returns (receive buffer, work, elements per rank)."""
    p = comm.group_size(group)
    sizes = [w * per_head for w in widths]
    recv, work = comm.all_to_all_split(send, [send.numel() // p] * p, sizes, group, stats, channel, device,
                                       async_op=async_op)
    return recv, work, sizes


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _blocks(recv: torch.Tensor, sizes: list[int], b: int, s: int, d: int) -> list[torch.Tensor]:
    """A flat receive buffer of uneven per-rank pieces -> [B, s, w_i, D] views."""
    return [recv[o : o + n].view(b, s, -1, d) for o, n in zip(_offsets(sizes), sizes)]


def _even_recv(recv: torch.Tensor, p: int, b: int, s: int, d: int) -> torch.Tensor:
    """A flat receive buffer of P equal pieces (this rank's heads of every rank's shard) -> [B, P*s, w, D]."""
    return _as_full_seq(recv.view(p, b, s, -1, d))


class _FusedUlysses(torch.autograd.Function):
    """Pure Ulysses over `plan` = the RankHeads of every rank: q/k/v in one (uneven) all-to-all per chunk,
    the kernel on this rank's heads, the output back in one; dummy heads are sent only where rank_heads
    keeps them. The original (unpadded) q, k, v go in and out: no padded copies exist."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, stats, device, causal, scale, kernel, calls, chunks, ranks):
        p, me = comm.group_size(group), comm.group_rank(group)
        b, s, _, d = q.shape
        plans = [[r.chunk(c, chunks) for r in ranks] for c in range(chunks)]
        sends = []
        for pl in plans:  # pack and post every chunk's exchange before any compute
            sends.append(_to_ranks([(q, "q"), (k, "kv"), (v, "kv")], pl, group, stats, "ulysses_fwd", device, True))
        backs, saved = [], []
        for c, pl in enumerate(plans):
            recv, work = sends[c]
            work.wait()
            nq, nk = len(pl[me].q), len(pl[me].kv)
            x = _even_recv(recv, p, b, s, d)
            sends[c] = recv = work = None  # free the exchange buffers before the kernel runs (peak memory)
            if nq:
                sk = None if sinks is None else sinks_for_heads(sinks, pl[me].q)
                oh, lse = local_forward(kernel, x[:, :, :nq], x[:, :, nq : nq + nk], x[:, :, nq + nk :], calls, scale,
                                        sk)
                oh = oh.to(q.dtype)
            else:  # nothing for this rank in this chunk (dummy groups left out): it still takes part in the exchange
                oh, lse = x[:, :, :0], x.new_empty(b, p * s, 0)
            back = _pack_full_seq([oh], p).view(-1)  # chunk c's output travels while chunk c+1 computes
            backs.append(_back_to_seq(back, [len(r.q) for r in pl], b * s * d, group, stats, "ulysses_fwd", device,
                                      True))
            saved += [x, oh, lse]
        out = q.new_empty(q.shape)
        for c, pl in enumerate(plans):
            recv, work, sizes = backs[c]
            work.wait()
            for r, blk in zip(pl, _blocks(recv, sizes, b, s, d)):
                _scatter(out, blk, r.q, add=False)
            backs[c] = recv = work = None
        ctx.save_for_backward(*saved, sinks)
        ctx.args = (group, stats, device, scale, kernel, calls, plans, k.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        group, stats, device, scale, kernel, calls, plans, kv_shape = ctx.args
        p, me = comm.group_size(group), comm.group_rank(group)
        *saved, sinks = ctx.saved_tensors
        dsinks = None if sinks is None or not ctx.needs_input_grad[3] else torch.zeros_like(sinks)
        dout = dout.to(saved[1].dtype)
        b, s, _, d = dout.shape
        # autograd frees this node's saved tensors after this call unless it keeps the graph: then they are free
        # to go (or to be written over) as soon as the kernel has read them, before the exchange (peak memory)
        free = not _keeps_graph()
        douts = [_to_ranks([(dout, "q")], pl, group, stats, "ulysses_bwd", device, True) for pl in plans]
        backs = []
        for c, pl in enumerate(plans):
            recv, work = douts[c]
            work.wait()
            douts[c] = work = None
            x, oh, lse = saved[3 * c : 3 * c + 3]
            saved[3 * c : 3 * c + 3] = (None,) * 3
            dh = _even_recv(recv, p, b, s, d)
            if dsinks is not None and pl[me].q:
                g = sink_grad(dh, oh, lse, sinks_for_heads(sinks, pl[me].q))
                dsinks += heads_grad_to_sinks(g, pl[me].q, sinks.shape[0]).to(sinks.dtype)
            send = _head_grads(kernel, calls, scale, dh, x, oh, lse, pl[me], p, free)
            dh = None
            recv = None
            if free:  # the output, lse and (when the send buffer is a copy) x are read: gone before the exchange
                _release(x, oh, lse, keep=send)
            widths = [r.width for r in pl]
            backs.append((_back_to_seq(send, widths, b * s * d, group, stats, "ulysses_bwd", device, True), send))
            x = oh = lse = send = None
        dq = dk = dv = None
        for c, pl in enumerate(plans):
            (recv, work, sizes), send = backs[c]
            work.wait()
            if free:
                _release(send)  # sent: its bytes go before dq, dk, dv exist
            backs[c] = send = None
            if dq is None:
                dq, dk, dv, replicated = _grad_buffers(dout, dout.shape, kv_shape, [r for pl in plans for r in pl])
            _scatter_qkv(dq, dk, dv, _blocks(recv, sizes, b, s, d), pl, replicated)
            recv = work = None
        return dq, dk, dv, dsinks, *(None,) * 9


def _keeps_graph() -> bool:
    """Whether the running backward keeps the graph (retain_graph / create_graph): then saved tensors stay intact."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if probe is None else bool(probe())


def _release(*ts: torch.Tensor | None, keep: torch.Tensor | None = None) -> None:
    """Free the storage of tensors only this function holds (saved by it, read for the last time), now rather than
    when autograd drops the node; `keep`'s storage (the send buffer, possibly x's own) stays."""
    kept = keep.untyped_storage().data_ptr() if keep is not None and keep.numel() else None
    for t in ts:
        if t is not None and t.numel() and t.untyped_storage().data_ptr() != kept:
            t.untyped_storage().resize_(0)


def _head_grads(kernel: AttentionKernel, calls: tuple, scale: float, dout: torch.Tensor, x: torch.Tensor,
                oh: torch.Tensor, lse: torch.Tensor, mine: RankHeads, p: int, in_place: bool) -> torch.Tensor:
    """The kernel's dq, dk, dv on this rank's heads, as the flat send buffer of the gradient exchange
    ([P, B, s, w, D]: x's own layout). One kv head (and its q group) at a time, each group's gradients written
    where its q, k, v were read: with `in_place` over x itself (it is not read again), so only one group's
    gradients exist beside it; otherwise into a new buffer. B == 1: the buffer is the send buffer as it is."""
    nq, nk = len(mine.q), len(mine.kv)
    if not nq:
        return x.new_empty(0)
    dst, g = (x if in_place else torch.empty_like(x)), nq // nk
    for j in range(nk):
        qs, ks, vs = slice(j * g, (j + 1) * g), slice(nq + j, nq + j + 1), slice(nq + nk + j, nq + nk + j + 1)
        grads = local_backward(kernel, dout[:, :, qs], x[:, :, qs], x[:, :, ks], x[:, :, vs], oh[:, :, qs],
                               lse[:, :, qs], calls, scale)
        for sl, t in zip((qs, ks, vs), grads):
            dst[:, :, sl].copy_(t)
        del grads  # one group's gradients at a time
    return _pack_full_seq([dst], p).view(-1)


def fused_ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    plan: HeadPlan,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    calls: tuple,
    stats: comm.CommStats | None = None,
    device: torch.device | None = None,
    chunks: int = 1,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure Ulysses on the ORIGINAL q [B, s, Hq, D], k/v [B, s, Hkv, D] -> out [B, s, Hq, D], heads placed by
    `plan` (ulysses.head_plan) as `rank_heads(plan)` says: no padded copies, dummies sent only where needed.

    `calls`: the local kernel calls from `local.local_calls` (no q row in two of them). `chunks`: split
    each rank's kv heads (with their q groups) into that many near-equal parts, exchanged separately. `sinks`
    [Hq]: each original q head's sink logit (differentiable), or None."""
    return _FusedUlysses.apply(q, k, v, sinks, group, stats, device, causal, scale, kernel, calls, chunks,
                               rank_heads(plan))
