"""Where a ring rank's stretches of the sequence sit in the FULL sequence, and where documents cut them.

After Ulysses' all-to-all (or without one) a ring rank holds its segments whole (layout.ring_segments: one
for the contiguous layout, two for zigzag: chunks r and 2R-1-r). A recurrence runs in GLOBAL order, so the
chunks of all ring ranks are sorted by their start: chunk j's incoming state is chunk j-1's outgoing one,
whichever rank holds it (zigzag: 0 -> 1 -> ... -> R-1 -> R-1 -> ... -> 0, ring rank R-1 hands its first chunk's
state to its own second chunk). Packed documents restart the state (and the conv's history) at every
boundary, so a segment splits into pieces at the boundaries inside it; only a segment's first piece may
continue a document that began before the segment (`carries`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layout import Segment, ring_segments

__all__ = ["Chunk", "RingPlan", "ring_plan", "Piece"]


@dataclass(frozen=True)
class Chunk:
    start: int  # global start
    length: int
    owner: int  # ring rank holding it
    local: int  # its index among the owner's segments (local order)


@dataclass(frozen=True)
class Piece:
    lo: int  # offsets inside the segment
    hi: int
    carries: bool  # continues a document from before the segment: takes the incoming state and conv history


@dataclass(frozen=True)
class RingPlan:
    """One ring rank's view: its segments (local order), every chunk in global order, the documents."""

    full_len: int
    ring_rank: int
    ring_degree: int
    segments: tuple[Segment, ...]
    order: tuple[Chunk, ...]
    row_bounds: tuple[tuple[int, ...], ...]  # per row: inner document starts of the full sequence

    @property
    def packed(self) -> bool:
        return any(self.row_bounds)

    def offsets(self) -> list[int]:
        """Local offset of each segment in this rank's (head-space) sequence."""
        out, off = [], 0
        for _, n in self.segments:
            out.append(off)
            off += n
        return out

    def doc_start(self, row: int, pos: int) -> int:
        """The start of the document holding global position `pos` in `row` (0 for the first document)."""
        return max([0, *(b for b in self.row_bounds[row] if b <= pos)])

    def pieces(self, seg: int, row: int) -> list[Piece]:
        """Segment `seg` of `row` cut at the document starts inside it."""
        g, n = self.segments[seg]
        cuts = [b - g for b in self.row_bounds[row] if g < b < g + n] if self.row_bounds else []
        edges = [0, *cuts, n]
        first_carries = g > 0 and self.doc_start(row, g) < g
        return [Piece(a, b, first_carries and i == 0) for i, (a, b) in enumerate(zip(edges[:-1], edges[1:]))]

    def chunk_index(self, seg: int) -> int:
        """Position of this rank's segment `seg` in the global order."""
        return next(j for j, c in enumerate(self.order) if c.owner == self.ring_rank and c.local == seg)


def ring_plan(full_len: int, ring_degree: int, ring_rank: int, layout: str,
              row_bounds: tuple[tuple[int, ...], ...]) -> RingPlan:
    """The plan for `ring_rank` of a sequence of `full_len` tokens in `layout` (the mesh's effective layout)."""
    chunks = [Chunk(g, n, rr, i) for rr in range(ring_degree)
              for i, (g, n) in enumerate(ring_segments(full_len, ring_degree, rr, layout))]
    chunks.sort(key=lambda c: c.start)
    mine = tuple(ring_segments(full_len, ring_degree, ring_rank, layout))
    return RingPlan(full_len, ring_rank, ring_degree, mine, tuple(chunks), tuple(tuple(b) for b in row_bounds))
