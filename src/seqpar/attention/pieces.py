"""What a local attention computes, planned without tensors: pieces, and the kernel calls that run them.

A *piece* is a maximal (q range, kv range) rectangle of one document between a Q block and a KV block
(both given as global segments), either fully visible (non-causal) or an exact causal diagonal. With
grid-aligned segments (contiguous or zigzag chunks) no other case exists, so no masked kernel call and no
fully-masked row ever happens, and zigzag's off-diagonal steps are exactly half blocks.

A *kernel call* runs several pieces at once where the kernel has a variable-length ("varlen") form:
pieces with one causal flag whose q ranges are disjoint go into one call, each piece one sequence of the
call (cu_seqlens). A kernel without that form gets one call per piece. Examples: a packed row of 64
documents in a world of 1 (or on a Ulysses rank) is 64 causal pieces and ONE varlen call; a zigzag ring
step is at most one causal and one non-causal call, whatever the documents.

A sliding window of w tokens (q sees k iff 0 <= q - k <= w - 1, transformers' convention) is one more mask
shape: each rectangle above is cut to what is in reach. A rectangle wholly out of reach gives no piece (so a ring
step whose KV block no query can see computes nothing); one wholly in reach stays a fully visible rectangle or
a causal diagonal; the rest is cut into q tiles of `tile` rows, each with only the keys its rows can reach, and
becomes a *banded* piece (`band`: q row a sees key c iff lo <= a - c <= hi, in the piece's own coordinates)
unless the tile is wholly in reach. Work then grows as S x (w + tile), not S^2; rows that see no key are cut
off, so no kernel call ever has a fully-masked row. `tile=None` keeps each rectangle whole (a kernel with a
native window, FlashAttention, skips the out-of-reach blocks itself).

Everything here is pure Python on integers (cached: the same plans recur in every layer), tested on CPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

from ..layout import Segment

__all__ = ["Piece", "KernelCall", "plan_pieces", "plan_calls", "piece_flops", "visible_pairs", "single_call"]


@dataclass(frozen=True)
class Piece:
    q0: int  # local q offsets [q0, q1)
    q1: int
    k0: int  # local kv offsets [k0, k1) within the KV block
    k1: int
    causal: bool
    band: tuple[int, int] | None = None  # (lo, hi): q row a sees key c iff lo <= a - c <= hi (causal is False)


@dataclass(frozen=True)
class KernelCall:
    """One kernel launch: its pieces (one causal flag, disjoint q ranges sorted by q0), one sequence each. A banded
    piece is always a call of its own."""

    causal: bool
    pieces: tuple[Piece, ...]

    @property
    def band(self) -> tuple[int, int] | None:
        return self.pieces[0].band if len(self.pieces) == 1 else None

    @property
    def q_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.q0, p.q1) for p in self.pieces)

    @property
    def k_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.k0, p.k1) for p in self.pieces)

    @property
    def cu_q(self) -> tuple[int, ...]:
        return _cumulative(self.q_ranges)

    @property
    def cu_k(self) -> tuple[int, ...]:
        return _cumulative(self.k_ranges)

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in self.q_ranges)

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in self.k_ranges)

    def covers(self, n_q: int, n_k: int) -> bool:
        """Its q ranges tile [0, n_q) in order and its kv ranges tile [0, n_k) in order: the call's packed
        inputs and outputs are the local tensors themselves (no gather, no scatter)."""
        return _tiles(self.q_ranges, n_q) and _tiles(self.k_ranges, n_k)


def _cumulative(ranges) -> tuple[int, ...]:
    out = [0]
    for a, b in ranges:
        out.append(out[-1] + b - a)
    return tuple(out)


def _tiles(ranges, n: int) -> bool:
    return ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def _with_offsets(segs) -> list[tuple[int, int, int]]:
    out, off = [], 0
    for g, n in segs:
        out.append((g, n, off))
        off += n
    return out


def _doc_ranges(lo: int, hi: int, bounds) -> list[tuple[int, int]]:
    """Split global [lo, hi) at document boundaries."""
    if not bounds:
        return [(lo, hi)]
    cuts = [lo] + [b for b in bounds if lo < b < hi] + [hi]
    return list(zip(cuts[:-1], cuts[1:]))


def _doc_id(pos: int, bounds) -> int:
    return bisect.bisect_right(bounds, pos) if bounds else 0


def plan_pieces(
    q_segs: list[Segment], kv_segs: list[Segment], causal: bool, bounds: list[int] | None = None,
    window: int | None = None, tile: int | None = None,
) -> list[Piece]:
    """Pieces of work between a Q block and a KV block (both given as global segments).

    `bounds` are the inner document boundaries (cu_seqlens without its first and last entry). `window`: a causal
    sliding window of that many tokens (None: none); `tile`: the q rows of a banded piece (None: untiled).
    """
    return list(_plan_pieces(_key(q_segs), _key(kv_segs), causal, _key(bounds), window, tile))


def _key(x) -> tuple | None:
    return None if x is None else tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in x)


@lru_cache(maxsize=4096)
def _plan_pieces(q_segs, kv_segs, causal: bool, bounds, window: int | None = None,
                 tile: int | None = None) -> tuple[Piece, ...]:
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
                    for a0, a1, c0, c1, flag, band in _in_reach(qa, qb, da, db, p, window, tile):
                        pieces.append(Piece(a0 - gq + oq, a1 - gq + oq, c0 - gk + ok, c1 - gk + ok, flag, band))
    return tuple(_merge_pieces(pieces))


def _in_reach(qa: int, qb: int, ka: int, kb: int, diag: bool, window: int | None, tile: int | None):
    """What a sliding window leaves of the rectangle [qa, qb) x [ka, kb) (global; a causal diagonal when `diag`,
    else every k <= every q): (q0, q1, k0, k1, causal, band) in global coordinates."""
    if window is None:
        yield qa, qb, ka, kb, diag, None
        return
    w = window
    step = (qb - qa) if tile is None else tile
    for x0 in range(qa, qb, step):
        x1 = min(qb, x0 + step)
        k0, k1 = max(ka, x0 - w + 1), min(kb, x1)  # the keys some row of [x0, x1) can see
        r0, r1 = max(x0, k0), min(x1, k1 + w - 1)  # the rows that see at least one of them
        if k0 >= k1 or r0 >= r1:
            continue
        if diag and (r0, r1) == (k0, k1) and r1 - 1 - k0 <= w - 1:
            yield r0, r1, k0, k1, True, None  # a causal diagonal wholly inside the window
        elif r0 - (k1 - 1) >= 0 and (r1 - 1) - k0 <= w - 1:
            yield r0, r1, k0, k1, False, None  # every row sees every key
        else:
            off = r0 - k0  # global q - k = a - c + off
            yield r0, r1, k0, k1, False, (-off, w - 1 - off)


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
            plain = last is not None and not last.causal and not p.causal and last.band is None and p.band is None
            if plain and same(last, p) and touch(last, p):
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


def plan_calls(
    q_segs: list[Segment], kv_segs: list[Segment], causal: bool, bounds: list[int] | None, varlen: bool,
    window: int | None = None, tile: int | None = None,
) -> tuple[KernelCall, ...]:
    """The kernel calls for a (Q block, KV block) pair: one per piece without `varlen`; with it, the pieces
    grouped by causal flag into as few calls as keep every call's q rows disjoint (greedy by q0: a q row in
    two pieces of one flag, which zigzag can give, goes to a second call). Banded pieces: one call each."""
    return _plan_calls(_key(q_segs), _key(kv_segs), causal, _key(bounds), varlen, window, tile)


@lru_cache(maxsize=4096)
def _plan_calls(q_segs, kv_segs, causal, bounds, varlen: bool, window, tile) -> tuple[KernelCall, ...]:
    pieces = _plan_pieces(q_segs, kv_segs, causal, bounds, window, tile)
    if not varlen:
        return tuple(KernelCall(p.causal, (p,)) for p in pieces)
    calls: list[KernelCall] = [KernelCall(False, (p,)) for p in pieces if p.band is not None]
    for flag in (True, False):
        groups: list[list[Piece]] = []
        for p in sorted((p for p in pieces if p.causal == flag and p.band is None), key=lambda p: (p.q0, p.k0)):
            g = next((g for g in groups if g[-1].q1 <= p.q0), None)
            if g is None:
                groups.append([p])
            else:
                g.append(p)
        calls += [KernelCall(flag, tuple(g)) for g in groups]
    return tuple(calls)


def single_call(calls: tuple[KernelCall, ...], n_q: int, n_k: int) -> KernelCall | None:
    """The one call that covers the whole local q and kv in order (then no gather, scatter or merge), or None."""
    return calls[0] if len(calls) == 1 and calls[0].covers(n_q, n_k) else None


def piece_flops(pieces: list[Piece], batch: int, heads: int, head_dim: int) -> float:
    """Forward matmul FLOPs of a list of pieces: the (q, k) pairs each piece's mask lets through (causal pieces
    count half; banded ones their band)."""
    return sum(4.0 * batch * heads * head_dim * visible_pairs(p) for p in pieces)


def visible_pairs(p: Piece) -> int:
    """How many (q row, key) pairs of the piece its mask lets through."""
    nq, nk = p.q1 - p.q0, p.k1 - p.k0
    if p.band is not None:
        lo, hi = p.band  # row a sees keys max(0, a - hi) .. min(nk - 1, a - lo)
        return sum(max(0, min(nk - 1, a - lo) - max(0, a - hi) + 1) for a in range(nq))
    return nq * (nq + 1) // 2 if p.causal else nq * nk
