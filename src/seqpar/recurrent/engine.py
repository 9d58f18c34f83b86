"""Run a conv + linear recurrence over this ring rank's segments with state passing (model-agnostic driver).

Inputs are in head space (after Ulysses' all-to-all, or the local shard without one): x [B, n, C] the conv's
inputs and `side`, per-token tensors [B, n, ...] that bypass the conv (gates, step sizes). Per local segment
and per document piece (segments.RingPlan.pieces):

1. conv with history: the first piece of a segment that continues a document gets the halo (halo.py), every
   other piece starts from zeros (a document start);
2. the model's recurrence on the piece from a zero state, in parallel on every rank (`piece_fn`, e.g.
   delta.delta_piece or ssd.ssd_piece): its output, its final state b and, for a piece that continues a
   document, its transition M and a function giving the output's correction for an incoming state;
3. each segment's transition: (M of its only piece, b) when it continues a document and has no document start
   inside; (0, b of its last piece) otherwise; the ring combines them (combine.incoming_states);
4. output of a continuing piece += correction(S_in): o_t(S_in) = o_t(0) + (linear in S_in), exact because the
   recurrence is linear in its state.

Rows without packed documents run batched; packed rows run one row at a time (their documents differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..mesh import SequenceParallelMesh
from .combine import incoming_states, tie, zero_transition
from .halo import conv_with_halo, gather_halos
from .segments import RingPlan

__all__ = ["PieceResult", "ring_conv", "ring_recurrence"]


@dataclass
class PieceResult:
    out: torch.Tensor  # [b, L, ...] the piece's output from a zero incoming state
    final: torch.Tensor  # [b, ...] its outgoing state from a zero incoming state (fp32 / fp64)
    through: torch.Tensor | None = None  # M: how an incoming state reaches the outgoing one (continuing pieces)
    correct: Callable[[torch.Tensor], torch.Tensor] | None = None  # S_in [b, ...] -> output correction [b, L, ...]


PieceFn = Callable[[torch.Tensor, tuple[torch.Tensor, ...], bool], PieceResult]


@dataclass
class _Segment:
    outs: list[torch.Tensor]  # per row group: [b, L_seg, ...]
    trans: tuple[torch.Tensor, torch.Tensor]  # (M, b) over all rows
    fixes: list[tuple[int, int, int, Callable]]  # (row start, row stop, piece end) -> correction of rows' piece


def _row_groups(plan: RingPlan, batch: int) -> list[tuple[int, int]]:
    return [(0, batch)] if not plan.packed else [(i, i + 1) for i in range(batch)]


def _run_segment(plan: RingPlan, s: int, x: torch.Tensor, side: tuple[torch.Tensor, ...],
                 halo: torch.Tensor | None, conv: Callable, piece_fn: PieceFn, kind: str) -> _Segment:
    off = plan.offsets()[s]
    outs, ms, bs, fixes = [], [], [], []
    for r0, r1 in _row_groups(plan, x.shape[0]):
        pieces = plan.pieces(s, r0)
        parts, res = [], None
        for p in pieces:
            lo, hi = off + p.lo, off + p.hi
            h = halo[r0:r1] if (p.carries and halo is not None) else None
            y = conv_with_halo(conv, x[r0:r1, lo:hi], h)
            res = piece_fn(y, tuple(t[r0:r1, lo:hi] for t in side), p.carries)
            parts.append(res.out)
            if p.carries:
                fixes.append((r0, r1, p.hi, res.correct))
        if len(pieces) == 1 and pieces[0].carries:
            ms.append(res.through)
        else:
            ms.append(zero_transition(kind, res.final))
        bs.append(res.final)
        outs.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
    return _Segment(outs, (torch.cat(ms), torch.cat(bs)), fixes)


def ring_recurrence(x: torch.Tensor, side: tuple[torch.Tensor, ...], plan: RingPlan, mesh: SequenceParallelMesh,
                    conv: Callable[[torch.Tensor], torch.Tensor], piece_fn: PieceFn, kind: str, kernel_size: int,
                    mode: str = "chain") -> torch.Tensor:
    """The recurrence's output [B, n, ...] over this ring rank's segments (local order), exact as if the whole
    sequence ran on one rank. Collective over mesh.ring_group (every rank of it calls this, in the same order)."""
    halos, tails = gather_halos(x, plan, kernel_size, mesh)
    segs = [_run_segment(plan, s, x, side, halos[s], conv, piece_fn, kind) for s in range(len(plan.segments))]
    trans = [g.trans for g in segs]
    if tails is not None:  # backward: the halo gather's after the combine's, on every rank (combine.tie)
        trans[0] = (tie(trans[0][0], tails), trans[0][1])
    s_in = incoming_states(kind, plan, mesh, trans, mode)
    out = []
    groups = _row_groups(plan, x.shape[0])
    for g, state in zip(segs, s_in):
        rows = list(g.outs)
        for r0, r1, end, fix in g.fixes:
            k = next(i for i, (a, _) in enumerate(groups) if a == r0)
            y = rows[k]
            delta = fix(state[r0:r1]).to(y.dtype)
            rows[k] = torch.cat([y[:, :end] + delta, y[:, end:]], dim=1) if end < y.shape[1] else y + delta
        out.append(torch.cat(rows, dim=0) if len(rows) > 1 else rows[0])
    result = torch.cat(out, dim=1) if len(out) > 1 else out[0]
    return tie(result, *s_in) if plan.ring_degree > 1 else result  # every rank runs the combine's backward


def ring_conv(x: torch.Tensor, plan: RingPlan, mesh: SequenceParallelMesh,
              conv: Callable[[torch.Tensor], torch.Tensor], kernel_size: int) -> torch.Tensor:
    """A causal conv alone (no recurrence: LFM2's short convolutions) over this ring rank's segments: each
    segment's first piece gets its halo, a piece that starts a document starts from zeros. Collective over
    mesh.ring_group (the halo gather)."""
    halos, tails = gather_halos(x, plan, kernel_size, mesh)
    out = []
    for s, off in enumerate(plan.offsets()):
        rows = []
        for r0, r1 in _row_groups(plan, x.shape[0]):
            parts = [conv_with_halo(conv, x[r0:r1, off + p.lo : off + p.hi],
                                    halos[s][r0:r1] if (p.carries and halos[s] is not None) else None)
                     for p in plan.pieces(s, r0)]
            rows.append(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        out.append(torch.cat(rows, dim=0) if len(rows) > 1 else rows[0])
    result = torch.cat(out, dim=1) if len(out) > 1 else out[0]
    return tie(result, tails) if tails is not None else result  # every rank runs the gather's backward
