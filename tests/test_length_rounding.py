"""One rule rounds a row's length up to what a mesh splits (seqpar.layout.round_up_length): the collators
(padded_length), the planner (planner.limits.padded, zigzag by default as seqpar train) and the dynamic-SP cost
model (RowCost.full_length) give the same length for every degree and ring layout."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from seqpar.dynamic.cost import DegreeCost, RowCost
from seqpar.layout import padded_length, round_up_length
from seqpar.planner.limits import padded, split_multiple
from seqpar.planner.workload import Layout


def test_collators_planner_and_cost_model_round_alike():
    for n, r, u, layout in itertools.product(range(1, 50), (1, 2, 3, 4), (1, 2), ("zigzag", "contiguous")):
        mesh = SimpleNamespace(ring_degree=r, ulysses_degree=u, effective_layout=layout if r > 1 else "contiguous")
        want = padded_length(n, mesh)
        cost = RowCost(((r * u, DegreeCost(u, r, 0.0, (), 0.0, 0.0)),), 4, 2, 8, 1, 1.0, 1.0, layout)
        assert round_up_length(n, r, u, layout) == padded(n, Layout(ulysses=u, ring=r), layout) == want
        assert cost.full_length([[n]], r * u) == want
        assert want % split_multiple(Layout(ulysses=u, ring=r), layout) == 0 and want - n < 2 * r * u


def test_the_planner_rounds_for_a_contiguous_ring_too():
    assert padded(10, Layout(ring=4)) == 16  # zigzag: 2 x ring
    assert padded(10, Layout(ring=4), "contiguous") == 12  # a contiguous ring splits multiples of 4
