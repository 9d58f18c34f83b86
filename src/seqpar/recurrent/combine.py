"""Combine the chunks' affine state transitions across the ring: every chunk's incoming state.

A linear recurrence S_t = A_t S_{t-1} + B_t maps a chunk's incoming state to its outgoing one by an affine
function, S_out = M S_in + b, where M is the product of the chunk's A_t and b is the outgoing state from a zero
incoming state. Ranks compute (M, b) of their chunks in parallel; the incoming state of chunk j is then
S_in(0) = 0, S_in(j) = M_{j-1} S_in(j-1) + b_{j-1} in GLOBAL chunk order. Two ways to get it:

- "chain" (sequential hand-off): each owner waits for S_in(j), sends M_j S_in(j) + b_j to the owner of j+1
  (point-to-point, one state per hop: 2R-2 hops for the zigzag layout, whose middle step R-1 -> R stays on
  one rank, R-1 contiguous). Backward runs the chain in reverse:
  dS_out(j) = total dS_in(j+1); dS_in(j) += M_j^T dS_out(j); dM_j = dS_out(j) S_in(j)^T; db_j = dS_out(j).
- "scan": one all-gather of every chunk's (M, b) over the ring group, then each rank composes the prefix of
  its own chunks locally (every rank redoes the O(chunks) small products). Its backward is the all-gather's
  (a reduce-scatter of each rank's gradient for every chunk's (M, b)), taken by autograd.

A chunk that contains a document start passes nothing through (M = 0): the state restarts there.
Transitions come in three kinds: "matrix" (Gated DeltaNet: M [.., dk, dk] acting on S [.., dk, dv]), "scalar"
(Mamba2 / SSD: one decay per head, M [..] scaling S [.., p, n]) and "diagonal" (Mamba1's selective scan, the RG-LRU:
one decay per state entry, M shaped as S and multiplying it elementwise). States are fp32 (fp64 for fp64).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from ..errors import SeqParError
from ..mesh import STATE_PASSING, SequenceParallelMesh
from .segments import RingPlan

__all__ = ["MODES", "KINDS", "apply_transition", "transition_grads", "zero_transition", "incoming_states", "tie"]

MODES = STATE_PASSING
KINDS = ("matrix", "scalar", "diagonal")


def apply_transition(kind: str, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """M S (the state a chunk passes on from S, before its own b)."""
    if kind == "matrix":
        return m @ s
    return m * s if kind == "diagonal" else m[..., None, None] * s


def transition_grads(kind: str, m: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Given dL/d(M S) = g: (dL/dS, dL/dM)."""
    if kind == "matrix":
        return m.transpose(-1, -2) @ g, g @ s.transpose(-1, -2)
    if kind == "diagonal":
        return m * g, g * s
    return m[..., None, None] * g, (g * s).sum(dim=(-1, -2))


def zero_transition(kind: str, state: torch.Tensor) -> torch.Tensor:
    """The M of a chunk that passes nothing through (a document starts inside it), shaped for `state`."""
    if kind == "matrix":
        return state.new_zeros(*state.shape[:-1], state.shape[-2])
    return torch.zeros_like(state) if kind == "diagonal" else state.new_zeros(state.shape[:-2])


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.like = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (g, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.like))


def tie(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """x, unchanged; `others` get a zero gradient from it. A collective whose output a rank does not otherwise
    use (a halo nobody needs, the incoming state of the first chunk) would skip its backward on that rank only,
    and a backward that runs before another on one rank and after it on the next pairs different collectives:
    tying fixes both, every rank runs every collective's backward, in the same order."""
    return _Tie.apply(x, *others)


class _Chain(torch.autograd.Function):
    """Sequential hand-off over the ring group. Inputs: info, then M_0, b_0, M_1, b_1, ... of the local segments;
    outputs: S_in of each local segment."""

    @staticmethod
    def forward(ctx: Any, info: tuple, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kind, plan, mesh = info
        ms, bs = tensors[0::2], tensors[1::2]
        s_in: list[torch.Tensor] = [bs[0]] * len(bs)
        carry = None
        for j, c in _mine(plan):
            if j == 0:
                s = torch.zeros_like(bs[c.local])
            elif plan.order[j - 1].owner == plan.ring_rank:
                s = carry
            else:
                s = _p2p(mesh, None, None, bs[c.local], plan.order[j - 1].owner, "state_fwd")
            s_in[c.local] = s
            if j + 1 < len(plan.order):
                out = apply_transition(kind, ms[c.local], s) + bs[c.local]
                if plan.order[j + 1].owner == plan.ring_rank:
                    carry = out
                else:
                    _p2p(mesh, out, plan.order[j + 1].owner, None, None, "state_fwd")
        ctx.info = info
        ctx.save_for_backward(*ms, *s_in)
        return tuple(s_in)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        kind, plan, mesh = ctx.info
        saved = ctx.saved_tensors
        n = len(saved) // 2
        ms, s_in = saved[:n], saved[n:]
        dms = [torch.zeros_like(m) for m in ms]
        dbs = [torch.zeros_like(s) for s in s_in]
        carry = None
        for j, c in reversed(_mine(plan)):
            i = c.local
            g_in = grads[i] if grads[i] is not None else torch.zeros_like(s_in[i])
            g_out = None
            if j + 1 < len(plan.order):
                nxt = plan.order[j + 1].owner
                g_out = carry if nxt == plan.ring_rank else _p2p(mesh, None, None, s_in[i], nxt, "state_bwd")
            if g_out is not None:
                ds, dms[i] = transition_grads(kind, ms[i], s_in[i], g_out)
                g_in = g_in + ds
                dbs[i] = g_out
            if j > 0:
                prev = plan.order[j - 1].owner
                if prev == plan.ring_rank:
                    carry = g_in
                else:
                    _p2p(mesh, g_in, prev, None, None, "state_bwd")
        out: list[torch.Tensor | None] = [None]
        for dm, db in zip(dms, dbs):
            out += [dm, db]
        return tuple(out)


def _mine(plan: RingPlan) -> list[tuple[int, Any]]:
    return [(j, c) for j, c in enumerate(plan.order) if c.owner == plan.ring_rank]


def _p2p(mesh: SequenceParallelMesh, send: torch.Tensor | None, dst: int | None, like: torch.Tensor | None,
         src: int | None, channel: str) -> torch.Tensor | None:
    return comm.send_recv(send, dst, like, src, mesh.ring_group, mesh.stats, channel, device=mesh.comm_device)


def _scan(kind: str, plan: RingPlan, mesh: SequenceParallelMesh,
          trans: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """All-gather every chunk's (M, b), compose the prefix of each local chunk (autograd does the backward)."""
    m_shape, b_shape = trans[0][0].shape, trans[0][1].shape
    nm = trans[0][0].numel()
    flat = torch.stack([torch.cat([m.reshape(-1), b.reshape(-1)]) for m, b in trans])
    every = comm.all_gather(flat, mesh.ring_group, dim=0, stats=mesh.stats, device=mesh.comm_device).clone()
    per_rank = len(plan.segments)
    s_in = []
    for s in range(per_rank):
        state = torch.zeros(b_shape, dtype=flat.dtype, device=flat.device)
        for c in plan.order[: plan.chunk_index(s)]:
            row = every[c.owner * per_rank + c.local]
            state = apply_transition(kind, row[:nm].view(m_shape), state) + row[nm:].view(b_shape)
        s_in.append(tie(state, every))  # every rank's gather gets its backward (rank 0's first chunk uses none)
    return s_in


def incoming_states(kind: str, plan: RingPlan, mesh: SequenceParallelMesh,
                    trans: list[tuple[torch.Tensor, torch.Tensor]], mode: str = "chain") -> list[torch.Tensor]:
    """S_in of each local segment from every segment's (M, b) (collective over the ring group)."""
    if kind not in KINDS:
        raise SeqParError(f"transition kind {kind!r} is unknown: use one of {KINDS}")
    if mode not in MODES:
        raise SeqParError(f"state passing mode {mode!r} is unknown: use one of {MODES}")
    if plan.ring_degree == 1:  # one chunk: nothing comes in
        return [torch.zeros_like(b) for _, b in trans]
    if mode == "scan":
        return _scan(kind, plan, mesh, trans)
    flat = [t for pair in trans for t in pair]
    return list(_Chain.apply((kind, plan, mesh), *flat))
