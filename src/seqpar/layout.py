"""Which global sequence positions each rank holds, and shard/unshard between full and local.

Contiguous layout: SP rank s holds block s of sp_size equal blocks.
Zigzag layout (ring > 1): the sequence is cut into 2*ring chunks; ring rank r holds chunks r and
2*ring-1-r (in that order); ulysses rank u then takes its contiguous 1/ulysses piece of that pair.
With causal attention every ring rank then does the same work (USP paper, Alg. 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import comm
from .errors import SeqParError

if TYPE_CHECKING:
    from .mesh import SequenceParallelMesh

__all__ = [
    "Segment",
    "required_multiple",
    "round_up_length",
    "padded_length",
    "ring_segments",
    "rank_segments",
    "local_positions",
    "shard",
    "unshard",
]

Segment = tuple[int, int]  # (global start, length), in local order


def required_multiple(ring_degree: int, ulysses_degree: int, layout: str = "zigzag") -> int:
    """Full sequence lengths must be a multiple of this for the mesh to split them evenly."""
    if ring_degree > 1 and layout == "zigzag":
        return 2 * ring_degree * ulysses_degree
    return ring_degree * ulysses_degree


def round_up_length(length: int, ring_degree: int, ulysses_degree: int, layout: str = "zigzag") -> int:
    """`length` rounded up to what a mesh of these degrees splits evenly (required_multiple; a ring of 1 has no
    zigzag). The one rounding rule: the collators (padded_length), the planner and the dynamic-SP cost model."""
    m = required_multiple(ring_degree, ulysses_degree, layout)
    return -(-length // m) * m


def padded_length(length: int, mesh: SequenceParallelMesh) -> int:
    return round_up_length(length, mesh.ring_degree, mesh.ulysses_degree, mesh.effective_layout)


def ring_segments(seq_len: int, ring_degree: int, ring_rank: int, layout: str) -> list[Segment]:
    """Global segments held by one ring rank (the whole ulysses group), in local order."""
    if ring_degree == 1:
        return [(0, seq_len)]
    if layout == "zigzag":
        c = seq_len // (2 * ring_degree)
        return [(ring_rank * c, c), ((2 * ring_degree - 1 - ring_rank) * c, c)]
    n = seq_len // ring_degree
    return [(ring_rank * n, n)]


def _slice_segments(segs: list[Segment], start: int, length: int) -> list[Segment]:
    """The sub-list of segments covering local offsets [start, start+length)."""
    out, off = [], 0
    for g, n in segs:
        a, b = max(start, off), min(start + length, off + n)
        if a < b:
            out.append((g + a - off, b - a))
        off += n
    return out


def rank_segments(
    seq_len: int, ring_degree: int, ulysses_degree: int, ring_rank: int, ulysses_rank: int, layout: str
) -> list[Segment]:
    segs = ring_segments(seq_len, ring_degree, ring_rank, layout)
    piece = sum(n for _, n in segs) // ulysses_degree
    return _slice_segments(segs, ulysses_rank * piece, piece)


def check_length(seq_len: int, mesh: SequenceParallelMesh) -> None:
    m = required_multiple(mesh.ring_degree, mesh.ulysses_degree, mesh.effective_layout)
    if seq_len % m != 0:
        pad = -seq_len % m
        raise SeqParError(
            f"sequence length {seq_len} cannot be split over sp_size={mesh.sp_size} "
            f"(ring={mesh.ring_degree}, ulysses={mesh.ulysses_degree}, layout={mesh.effective_layout}): "
            f"it must be a multiple of {m}; pad by {pad} to {seq_len + pad} "
            f"(seqpar.data.SequenceParallelCollator pads for you)"
        )


def _positions(segs: list[Segment]) -> torch.Tensor:
    return torch.cat([torch.arange(g, g + n) for g, n in segs])


def local_positions(seq_len: int, mesh: SequenceParallelMesh, sp_rank: int | None = None) -> torch.Tensor:
    """Global positions (int64) held by an SP rank (default: this rank), in local order."""
    check_length(seq_len, mesh)
    s = mesh.sp_rank if sp_rank is None else sp_rank
    u = mesh.ulysses_degree
    segs = rank_segments(seq_len, mesh.ring_degree, u, s // u, s % u, mesh.effective_layout)
    return _positions(segs)


def shard(x: torch.Tensor, mesh: SequenceParallelMesh, dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor, in the layout seqpar.attention expects."""
    if mesh.sp_size == 1:
        return x
    idx = local_positions(x.shape[dim], mesh).to(x.device)
    return x.index_select(dim, idx)


def unshard(x: torch.Tensor, mesh: SequenceParallelMesh, dim: int = 1) -> torch.Tensor:
    """Inverse of shard: every rank gets the full tensor. Differentiable (backward = sum reduce-scatter)."""
    if mesh.sp_size == 1:
        return x
    full_len = x.shape[dim] * mesh.sp_size
    gathered = comm.all_gather(x, mesh.sp_group, dim=dim, stats=mesh.stats, device=mesh.comm_device)
    order = torch.cat([local_positions(full_len, mesh, s) for s in range(mesh.sp_size)])
    inv = torch.empty_like(order)
    inv[order] = torch.arange(full_len)
    return gathered.index_select(dim, inv.to(x.device))
