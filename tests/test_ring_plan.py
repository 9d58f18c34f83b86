"""The ring's work plan: zigzag balances causal FLOPs exactly; pieces never cross documents."""

from __future__ import annotations

import pytest

from seqpar.attention.pieces import plan_pieces
from seqpar.layout import ring_segments


def _area(p):
    n = p.q1 - p.q0
    return n * (n + 1) // 2 if p.causal else n * (p.k1 - p.k0)


@pytest.mark.parametrize("ring", [2, 3, 4, 8])
def test_zigzag_off_diagonal_steps_are_exact_half_blocks(ring):
    s = 2 * ring * 8
    segs = [ring_segments(s, ring, r, "zigzag") for r in range(ring)]
    block = (s // ring) ** 2
    per_rank = []
    for r in range(ring):
        total = 0
        for j in range(ring):
            pieces = plan_pieces(segs[r], segs[j], causal=True)
            area = sum(_area(p) for p in pieces)
            if j != r:
                assert area == block // 2, "an off-diagonal zigzag step must be exactly half a block"
                assert len(pieces) == 1, "half blocks should be one fused kernel call"
            total += area
        per_rank.append(total)
    assert max(per_rank) == min(per_rank), per_rank


def test_contiguous_causal_is_unbalanced():
    ring, s = 4, 64
    segs = [ring_segments(s, ring, r, "contiguous") for r in range(ring)]
    work = [sum(_area(p) for j in range(ring) for p in plan_pieces(segs[r], segs[j], True)) for r in range(ring)]
    assert work[-1] > 3 * work[0]


def test_pieces_respect_documents():
    segs = ring_segments(32, 2, 0, "zigzag")  # positions 0-7 and 24-31
    bounds = [3, 26]
    for p in plan_pieces(segs, segs, True, bounds):
        pos_q = [(list(range(0, 8)) + list(range(24, 32)))[i] for i in range(p.q0, p.q1)]
        pos_k = [(list(range(0, 8)) + list(range(24, 32)))[i] for i in range(p.k0, p.k1)]
        doc = lambda x: sum(x >= b for b in bounds)
        assert len({doc(x) for x in pos_q + pos_k}) == 1
