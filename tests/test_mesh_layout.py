"""Mesh degree choice, validation, layouts and the Ulysses head plan (single process)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpar
from seqpar.attention.ulysses import head_plan, rank_heads, sent_heads
from seqpar.layout import local_positions, required_multiple
from seqpar.mesh import SequenceParallelMesh, auto_degrees


@pytest.mark.parametrize(
    "sp,hq,hkv,expect",
    [
        (4, 14, 2, (2, 2)),  # Qwen2.5-0.5B: ulysses 2 (kv heads), ring 2
        (2, 9, 3, (1, 2)),  # SmolLM2: 2 divides neither 9 nor 3 -> pure ring
        (3, 9, 3, (3, 1)),
        (8, 28, 4, (4, 2)),
        (8, 32, 8, (8, 1)),
        (16, 32, 8, (8, 2)),
        (6, 12, 6, (6, 1)),
        (5, 8, 8, (1, 5)),
    ],
)
def test_auto_degrees_with_heads(sp, hq, hkv, expect):
    assert auto_degrees(sp, hq, hkv) == expect


def test_auto_degrees_default_is_pure_ring():
    assert auto_degrees(6) == (1, 6)


def test_init_mesh_single_process():
    mesh = seqpar.init_mesh(1)
    assert (mesh.sp_size, mesh.dp_size, mesh.sp_rank) == (1, 1, 0)
    x = torch.randn(2, 5, 3)
    assert seqpar.shard(x, mesh) is x and seqpar.unshard(x, mesh) is x


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(sp_size=0), "positive int"),
        (dict(sp_size=2), "does not divide world_size=1"),
        (dict(sp_size=1, layout="spiral"), "layout='spiral'"),
        (dict(sp_size=1, num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"),
        (dict(sp_size=1, ulysses_degree=2), "must divide sp_size=1"),
    ],
)
def test_init_mesh_errors(kwargs, needle):
    with pytest.raises(seqpar.SeqParError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        seqpar.init_mesh(**kwargs)


def _fake_mesh(ring, uly, layout="zigzag"):
    return SequenceParallelMesh(dp_size=1, ring_degree=ring, ulysses_degree=uly, layout=layout)


@settings(max_examples=80, deadline=None)
@given(
    ring=st.integers(1, 5), uly=st.integers(1, 4), layout=st.sampled_from(["zigzag", "contiguous"]),
    mult=st.integers(1, 6), feat=st.integers(1, 3),
)
def test_shard_positions_are_a_permutation_and_round_trip(ring, uly, layout, mult, feat):
    mesh = _fake_mesh(ring, uly, layout)
    s = required_multiple(ring, uly, mesh.effective_layout) * mult
    x = torch.randn(2, s, feat)
    pieces, order = [], []
    for r in range(mesh.sp_size):
        pos = local_positions(s, mesh, r)
        assert len(pos) == s // mesh.sp_size
        order.append(pos)
        pieces.append(x.index_select(1, pos))
    order = torch.cat(order)
    assert sorted(order.tolist()) == list(range(s))
    full = torch.empty_like(x)
    full[:, order] = torch.cat(pieces, 1)
    assert torch.equal(full, x)


def test_zigzag_layout_matches_usp_paper():
    # ring 2, ulysses 2, S=16: chunks of 4; ring rank 0 holds chunks 0 and 3, ring rank 1 chunks 1 and 2
    mesh = _fake_mesh(2, 2)
    got = [local_positions(16, mesh, r).tolist() for r in range(4)]
    assert got == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert local_positions(8, _fake_mesh(1, 2), 1).tolist() == [4, 5, 6, 7]


def test_shard_error_says_how_much_to_pad():
    mesh = _fake_mesh(2, 1)
    with pytest.raises(seqpar.SeqParError, match="pad by 3 to 8"):
        local_positions(5, mesh, 0)


@pytest.mark.parametrize(
    "hq,hkv,p",
    [(14, 2, 4), (9, 3, 2), (9, 3, 4), (28, 4, 8), (32, 8, 8), (32, 8, 16), (4, 1, 4), (6, 2, 4), (8, 8, 3), (5, 5, 2)],
)
def test_head_plan_keeps_gqa_mapping(hq, hkv, p):
    plan = head_plan(hq, hkv, p)
    assert plan.padded_heads % p == 0 and plan.expanded_kv_heads % p == 0
    assert sorted(h for h in plan.q_src if h >= 0) == list(range(hq))
    g0, g = hq // hkv, plan.group
    q_per_rank, kv_per_rank = plan.padded_heads // p, plan.expanded_kv_heads // p
    for rank in range(p):
        for j in range(q_per_rank):
            src = plan.q_src[rank * q_per_rank + j]
            local_kv = rank * kv_per_rank + j // g  # what the rank's local GQA mapping pairs it with
            if src >= 0:
                assert plan.kv_src[local_kv] == src // g0, "query head paired with the wrong KV head"


@pytest.mark.parametrize(
    "shape,expect",
    [
        ((14, 2, 4), (16, 4)),  # pad each 7-head group to 8, replicate kv to 4
        ((6, 6, 4), (8, 8)),  # two dummy (q, kv) pairs beat replicating every head (12/12)
        ((9, 3, 2), (12, 4)),  # one dummy kv group: 4 groups of 3 q (12/6 before)
        ((8, 2, 4), (8, 4)),  # kv < P: replicate kv, no dummy
        ((32, 8, 8), (32, 8)),
    ],
)
def test_head_plan_moves_fewest_heads(shape, expect):
    plan = head_plan(*shape)
    assert (plan.padded_heads, plan.expanded_kv_heads) == expect
    assert plan.is_identity == (expect == shape[:2])


@pytest.mark.parametrize(
    "hq,hkv,p",
    [(14, 2, 4), (9, 3, 2), (9, 3, 4), (28, 4, 8), (32, 8, 16), (4, 1, 4), (6, 2, 4), (8, 8, 3), (5, 5, 2),
     (6, 6, 4), (18, 6, 4), (12, 3, 4), (10, 2, 3), (15, 3, 2)],
)
def test_rank_heads_send_each_real_head_once_with_gqa_intact(hq, hkv, p):
    """Pure Ulysses' per-rank head sets: every real q head exactly once, each rank's GQA groups uniform and
    pairing every q head with its own kv head, never more heads than the padded plan moves."""
    plan = head_plan(hq, hkv, p)
    ranks = rank_heads(plan)
    assert len(ranks) == p
    assert sorted(h for r in ranks for h in r.q if h >= 0) == list(range(hq))
    for r in ranks:
        assert (len(r.q) == 0) == (len(r.kv) == 0) and all(kv >= 0 for kv in r.kv)
        if r.kv:
            g = len(r.q) // len(r.kv)
            assert g * len(r.kv) == len(r.q)
            assert all(h < 0 or r.kv[j // g] == h // (hq // hkv) for j, h in enumerate(r.q))
    q, kv = sent_heads(plan)
    assert q <= plan.padded_heads and kv <= plan.expanded_kv_heads


@pytest.mark.parametrize(
    "shape,q_per_rank,kv_per_rank,dummies",
    [
        ((14, 2, 4), [4, 3, 4, 3], [1, 1, 1, 1], 0),  # the plan's 2 dummy q heads are not sent
        ((6, 6, 4), [2, 2, 2, 0], [2, 2, 2, 0], 0),  # the plan's 2 dummy kv groups are not sent
        ((9, 3, 2), [6, 3], [2, 1], 0),
        ((8, 8, 2), [4, 4], [4, 4], 0),  # identity plan: unchanged
        ((18, 6, 4), [6, 6, 6, 0], [2, 2, 2, 0], 0),
        # ranks 1 and 2 hold slots with 2 and 1 real q heads: a uniform GQA group keeps their dummies (zeros)
        ((10, 2, 3), [4, 4, 4], [2, 2, 2], 2),
    ],
)
def test_rank_heads_leave_out_dummies(shape, q_per_rank, kv_per_rank, dummies):
    ranks = rank_heads(head_plan(*shape))
    assert [len(r.q) for r in ranks] == q_per_rank and [len(r.kv) for r in ranks] == kv_per_rank
    assert sum(h < 0 for r in ranks for h in r.q) == dummies
