"""Collators and sampler vs an independent single-process reference.

The reference below is plain Python lists (no seqpar code): it builds the no-SP batch (labels
shifted per document, positions, cu_seqlens, padding to a given length). SP outputs are
reassembled from every SP rank and must equal it exactly (integers: no tolerance).
Most meshes are simulated in one process (the collator does no communication, it only reads the
mesh's ranks); one spawned world of 4 ranks checks real `init_mesh` meshes and `seqpar.unshard`.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import seqpar
from seqpar.data import (
    SequenceParallelCollator,
    SequenceParallelDPOCollator,
    SequenceParallelSampler,
    sp_sampler,
)
from seqpar.layout import local_positions
from seqpar.mesh import SequenceParallelMesh
from seqpar.spawn import run_distributed

IGN = -100
PAD = 0


# ----------------------------------------------------------------------------- independent reference
def ref_docs(row: dict) -> list[tuple[list[int], list[int]]]:
    """Split a row into documents [(ids, labels)] using its position_ids restarts (0)."""
    ids = list(row["input_ids"])
    labels = list(row.get("labels") or ids)
    pos = list(row.get("position_ids") or range(len(ids)))
    docs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or pos[i] == 0:
            docs.append((ids[start:i], labels[start:i]))
            start = i
    return docs


def ref_collate(rows: list[dict], packing: bool, full_len: int) -> dict:
    """No-SP batch as python lists: input_ids, position_ids, shift_labels, cu_seqlens, counts."""
    seqs = []
    for row in rows:
        ids, pos, tgt = [], [], []
        for d_ids, d_lab in ref_docs(row):
            for j in range(len(d_ids)):
                ids.append(d_ids[j])
                pos.append(j)
                nxt = d_lab[j + 1] if j + 1 < len(d_ids) else IGN
                tgt.append(nxt if nxt >= 0 else IGN)
        seqs.append((ids, pos, tgt))
    out = {"input_ids": [], "position_ids": [], "shift_labels": []}
    if packing:
        ids = [t for s in seqs for t in s[0]]
        pos = [t for s in seqs for t in s[1]]
        tgt = [t for s in seqs for t in s[2]]
        pad = full_len - len(ids)
        out["input_ids"] = [ids + [PAD] * pad]
        out["position_ids"] = [pos + list(range(pad))]
        out["shift_labels"] = [tgt + [IGN] * pad]
        cu = [0]
        for row in rows:
            for d_ids, _ in ref_docs(row):
                cu.append(cu[-1] + len(d_ids))
        if pad:
            cu.append(full_len)
        out["cu_seqlens"] = cu
    else:
        for ids, pos, tgt in seqs:
            pad = full_len - len(ids)
            out["input_ids"].append(ids + [PAD] * pad)
            out["position_ids"].append(pos + list(range(len(ids), full_len)))
            out["shift_labels"].append(tgt + [IGN] * pad)
    out["num_supervised_tokens"] = sum(t != IGN for s in seqs for t in s[2])
    out["num_input_tokens"] = sum(len(s[0]) for s in seqs)
    return out


def ref_full_len(rows: list[dict], packing: bool, multiple: int) -> int:
    n = sum(len(r["input_ids"]) for r in rows) if packing else max(len(r["input_ids"]) for r in rows)
    return -(-n // multiple) * multiple


def sim_mesh(ring: int, uly: int, sp_rank: int, layout: str = "zigzag", dp_size: int = 1, dp_rank: int = 0):
    """A mesh object as rank `sp_rank` would hold it (no process groups: the collator needs none)."""
    return SequenceParallelMesh(
        dp_size=dp_size, ring_degree=ring, ulysses_degree=uly, dp_rank=dp_rank,
        ring_rank=sp_rank // uly, ulysses_rank=sp_rank % uly, layout=layout,
    )


def reassemble(per_rank: list[dict], ring: int, uly: int, layout: str) -> dict:
    """Put every SP rank's shard back at its global positions (independent of seqpar.unshard)."""
    mesh0 = sim_mesh(ring, uly, 0, layout)
    s_loc = per_rank[0]["input_ids"].shape[1]
    full_len = s_loc * ring * uly
    out = {}
    for key in ("input_ids", "position_ids", "shift_labels"):
        b = per_rank[0][key].shape[0]
        full = torch.full((b, full_len), -12345, dtype=torch.long)
        for s, res in enumerate(per_rank):
            full[:, local_positions(full_len, mesh0, s)] = res[key]
        assert (full != -12345).all(), "some position is held by no rank"
        out[key] = full.tolist()
    return out


def make_rows(rng: random.Random, n_rows: int, lengths: list[int], vocab: int = 50) -> list[dict]:
    rows = []
    for i in range(n_rows):
        n = lengths[i % len(lengths)]
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        labels = [t if rng.random() < 0.7 else IGN for t in ids]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


MESHES = [  # (ring, ulysses, layout): contiguous (ulysses), zigzag (ring), USP, sp in {2, 3, 4}
    (1, 2, "zigzag"), (1, 3, "zigzag"), (1, 4, "zigzag"),
    (2, 1, "zigzag"), (3, 1, "zigzag"), (4, 1, "zigzag"),
    (2, 2, "zigzag"), (3, 1, "contiguous"),
]


def check_against_reference(rows, ring, uly, layout, packing):
    per_rank, fulls = [], []
    for s in range(ring * uly):
        col = SequenceParallelCollator(sim_mesh(ring, uly, s, layout), PAD, packing=packing)
        per_rank.append(col(rows))
    got = reassemble(per_rank, ring, uly, layout)
    mesh0 = sim_mesh(ring, uly, 0, layout)
    mult = seqpar.required_multiple(ring, uly, mesh0.effective_layout)
    ref = ref_collate(rows, packing, ref_full_len(rows, packing, mult))
    for key in ("input_ids", "position_ids", "shift_labels"):
        assert got[key] == ref[key], key
    for res in per_rank:  # counts describe the FULL batch: identical on every SP rank
        assert int(res["num_supervised_tokens"]) == ref["num_supervised_tokens"]
        assert int(res["num_input_tokens"]) == ref["num_input_tokens"]
        assert int(res["num_truncated_tokens"]) == 0
        if packing:
            assert res["cu_seqlens"].dtype == torch.int32
            assert res["cu_seqlens"].tolist() == ref["cu_seqlens"]
        else:
            assert "cu_seqlens" not in res
        assert "labels" not in res  # unshifted labels would be shifted per shard by an HF model
    fulls.append(got)
    return per_rank


@pytest.mark.parametrize("ring,uly,layout", MESHES)
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_collator_matches_no_sp_reference(ring, uly, layout, packing, batch):
    rng = random.Random(ring * 100 + uly * 10 + batch + packing)
    # Lengths not divisible by any multiple used here (13, 7, 22), several documents when packing.
    rows = make_rows(rng, batch if not packing else batch + 1, [13, 7, 22])
    check_against_reference(rows, ring, uly, layout, packing)


@pytest.mark.parametrize("ring,uly,layout", [(4, 1, "zigzag"), (1, 3, "zigzag"), (2, 2, "zigzag")])
@pytest.mark.parametrize("packing", [False, True])
def test_supervision_on_one_shard_only(ring, uly, layout, packing):
    n = 24 * ring * uly // 4
    ids = list(range(1, n + 1))
    labels = [IGN] * n
    labels[2:4] = ids[2:4]  # targets only at positions 1, 2 -> all on the first shard
    rows = [{"input_ids": ids, "labels": labels}, {"input_ids": ids[:5]}]
    per_rank = check_against_reference(rows, ring, uly, layout, packing)
    local = [int((r["shift_labels"] != IGN).sum()) for r in per_rank]
    # The case is meaningful: some rank holds no supervised target at all.
    assert 0 in local and sum(local) == int(per_rank[0]["num_supervised_tokens"])


def test_packed_row_with_position_ids_restarts():
    # One input row already holding two documents (position_ids restart at 0), plus a plain row.
    rows = [
        {"input_ids": [3, 4, 5, 6, 7], "position_ids": [0, 1, 2, 0, 1]},
        {"input_ids": [8, 9, 10], "labels": [IGN, 9, 10]},
    ]
    per_rank = check_against_reference(rows, 2, 1, "zigzag", True)
    assert per_rank[0]["cu_seqlens"].tolist() == [0, 3, 5, 8]  # 8 == padded length, no pad doc
    full = SequenceParallelCollator(sim_mesh(2, 1, 0), PAD, packing=True).collate_full(rows)
    # Token 5 (end of document 1) must not predict token 6 (start of document 2).
    assert full["shift_labels"][0].tolist() == [4, 5, IGN, 7, IGN, 9, 10, IGN]


def test_attention_mask_drops_tokenizer_padding():
    mesh = sim_mesh(1, 1, 0)
    col = SequenceParallelCollator(mesh, PAD)
    a = col([{"input_ids": [0, 0, 5, 6, 7], "attention_mask": [0, 0, 1, 1, 1]}])  # left padded
    b = col([{"input_ids": [5, 6, 7]}])
    for k in ("input_ids", "position_ids", "shift_labels", "num_supervised_tokens", "num_input_tokens"):
        assert torch.equal(a[k], b[k]), k


def test_zigzag_worked_example_from_docs():
    # The example in docs/data_and_loss.md: ring=2, rows [1..6] (all supervised) and [7, 8, 9].
    rows = [{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [7, 8, 9]}]
    full = SequenceParallelCollator(sim_mesh(2, 1, 0), PAD, packing=True).collate_full(rows)
    assert full["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]
    assert full["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2]]
    assert full["shift_labels"].tolist() == [[2, 3, 4, 5, 6, IGN, 8, 9, IGN, IGN, IGN, IGN]]
    assert full["cu_seqlens"].tolist() == [0, 6, 9, 12]
    r0 = SequenceParallelCollator(sim_mesh(2, 1, 0), PAD, packing=True)(rows)
    r1 = SequenceParallelCollator(sim_mesh(2, 1, 1), PAD, packing=True)(rows)
    assert r0["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0]]  # chunks 0 and 3
    assert r0["shift_labels"].tolist() == [[2, 3, 4, IGN, IGN, IGN]]
    assert r1["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9]]  # chunks 1 and 2
    assert r1["shift_labels"].tolist() == [[5, 6, IGN, 8, 9, IGN]]
    assert r1["position_ids"].tolist() == [[3, 4, 5, 0, 1, 2]]


def test_dpo_collator_layout():
    pairs = [
        {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5], "rejected_input_ids": [6]},
        {"prompt_input_ids": [7], "chosen_input_ids": [8, 9, 10, 11], "rejected_input_ids": [12, 13]},
    ]
    ring, uly = 2, 1
    per_rank = [SequenceParallelDPOCollator(sim_mesh(ring, uly, s), PAD)(pairs) for s in range(2)]
    got = reassemble(per_rank, ring, uly, "zigzag")
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [IGN, IGN, IGN, 4, 5]},
        {"input_ids": [7, 8, 9, 10, 11], "labels": [IGN, 8, 9, 10, 11]},
        {"input_ids": [1, 2, 3, 6], "labels": [IGN, IGN, IGN, 6]},
        {"input_ids": [7, 12, 13], "labels": [IGN, 12, 13]},
    ]
    ref = ref_collate(rows, False, 8)
    for key in ("input_ids", "position_ids", "shift_labels"):
        assert got[key] == ref[key], key
    assert int(per_rank[1]["num_pairs"]) == 2
    assert int(per_rank[1]["num_supervised_tokens"]) == ref["num_supervised_tokens"] == 9


def test_max_length_truncates_and_reports():
    mesh = sim_mesh(2, 1, 0)
    rows = [{"input_ids": list(range(1, 11))}, {"input_ids": [1, 2, 3]}]
    full = SequenceParallelCollator(mesh, PAD, max_length=6).collate_full(rows)
    assert int(full["num_truncated_tokens"]) == 4
    assert full["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert full["shift_labels"][0].tolist()[:6] == [2, 3, 4, 5, 6, IGN]  # no target beyond the cut
    packed = SequenceParallelCollator(mesh, PAD, packing=True, max_length=8).collate_full(rows)
    assert int(packed["num_truncated_tokens"]) == 5  # 10 -> 8 (row cap), then 8 + 3 -> 8 (pack cap)
    assert packed["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(seqpar.SeqParError, match="max_length"):
        SequenceParallelCollator(mesh, PAD, max_length=6, truncate=False)(rows)
    with pytest.raises(seqpar.SeqParError, match="max_length"):
        SequenceParallelCollator(mesh, PAD, packing=True, max_length=12, truncate=False)(rows)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([], "empty batch"),
        ({"input_ids": [1]}, "list of row dicts"),
        ([{"labels": [1, 2]}], "no 'input_ids'"),
        ([{"input_ids": [1, 2, 3], "labels": [1, 2]}], "must match"),
        ([{"input_ids": []}], "no tokens"),
        ([{"input_ids": [[1, 2], [3, 4]]}], "1-D"),
        ([{"input_ids": [1.5, 2.0]}], "integers"),
        ([{"input_ids": [1, 2, 3], "position_ids": [0, 1, 0]}], "packing=True"),
        (["abc"], "must be a dict"),
        ([{"input_ids": [1, -100, 3]}], "negative id"),
    ],
)
def test_bad_rows_raise(rows, match):
    with pytest.raises(seqpar.SeqParError, match=match):
        SequenceParallelCollator(sim_mesh(2, 1, 0), PAD)(rows)


def test_bad_collator_args_and_dpo_rows():
    mesh = sim_mesh(1, 2, 0)
    with pytest.raises(seqpar.SeqParError, match="pad_token_id"):
        SequenceParallelCollator(mesh, None)
    assert SequenceParallelCollator(mesh, torch.tensor(3)).pad_token_id == 3
    with pytest.raises(seqpar.SeqParError, match="label_pad"):
        SequenceParallelCollator(mesh, 0, label_pad=5)
    with pytest.raises(seqpar.SeqParError, match="max_length"):
        SequenceParallelCollator(mesh, 0, max_length=0)
    with pytest.raises(seqpar.SeqParError, match="SequenceParallelMesh"):
        SequenceParallelCollator("mesh", 0)
    with pytest.raises(seqpar.SeqParError, match="rejected_input_ids"):
        SequenceParallelDPOCollator(mesh, 0)([{"prompt_input_ids": [1], "chosen_input_ids": [2]}])
    with pytest.raises(seqpar.SeqParError, match="must start at 0"):
        SequenceParallelCollator(mesh, 0, packing=True)([{"input_ids": [1, 2], "position_ids": [3, 4]}])


# ----------------------------------------------------------------------------- hypothesis property test
row_strategy = st.lists(
    st.tuples(st.integers(1, 99), st.booleans()), min_size=1, max_size=17
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(row_strategy, min_size=1, max_size=4),
    mesh_i=st.integers(0, len(MESHES) - 1),
    packing=st.booleans(),
    merge_first=st.booleans(),
)
def test_shift_and_packing_invariants(rows, mesh_i, packing, merge_first):
    ring, uly, layout = MESHES[mesh_i]
    # The documents, in order, as (ids, labels).
    docs = [([t for t, _ in r], [t if s else IGN for t, s in r]) for r in rows]
    batch = [{"input_ids": d[0], "labels": d[1]} for d in docs]
    if packing and merge_first and len(docs) > 1:
        # The first input row already holds two documents: position_ids restart at 0 inside it.
        (a_ids, a_lab), (b_ids, b_lab) = docs[0], docs[1]
        merged = {"input_ids": a_ids + b_ids, "labels": a_lab + b_lab,
                  "position_ids": list(range(len(a_ids))) + list(range(len(b_ids)))}
        batch = [merged] + batch[2:]
    mesh = sim_mesh(ring, uly, 0, layout)
    full = SequenceParallelCollator(mesh, PAD, packing=packing).collate_full(batch)
    ids, pos, tgt = full["input_ids"], full["position_ids"], full["shift_labels"]
    length = ids.shape[1]
    assert length % seqpar.required_multiple(ring, uly, mesh.effective_layout) == 0
    row_docs = [docs] if packing else [[d] for d in docs]
    for b, row in enumerate(row_docs):
        off = 0
        for d_ids, d_lab in row:
            n = len(d_ids)
            assert ids[b, off : off + n].tolist() == d_ids
            assert pos[b, off : off + n].tolist() == list(range(n))  # positions reset per document
            # target j = label j+1 inside the document; never across its end
            assert tgt[b, off : off + n].tolist() == d_lab[1:] + [IGN]
            off += n
        assert (tgt[b, off:] == IGN).all() and (ids[b, off:] == PAD).all()  # padding never supervised
        if packing:
            assert full["cu_seqlens"].tolist()[: len(row) + 1] == [0] + [
                sum(len(d[0]) for d in row[: i + 1]) for i in range(len(row))
            ]
            assert int(full["cu_seqlens"][-1]) == length
    assert int(full["num_supervised_tokens"]) == sum(sum(x != IGN for x in lab[1:]) for _, lab in docs)
    # Sharding loses nothing: the local supervised counts add up to the full count.
    local = sum(
        int((SequenceParallelCollator(sim_mesh(ring, uly, s, layout), PAD, packing=packing)(batch)["shift_labels"]
             != IGN).sum())
        for s in range(ring * uly)
    )
    assert local == int(full["num_supervised_tokens"])


# ----------------------------------------------------------------------------- sampler
def test_sampler_same_rows_per_sp_group_disjoint_across_dp():
    n, dp, sp = 23, 3, 2
    per = {}
    for d in range(dp):
        for s in range(sp):
            mesh = sim_mesh(sp, 1, s, dp_size=dp, dp_rank=d)
            sampler = sp_sampler(n, mesh, shuffle=True, seed=7)
            sampler.set_epoch(2)
            per[d, s] = list(sampler)
    for d in range(dp):
        assert per[d, 0] == per[d, 1]  # every SP rank of the group: the same rows
    flat = [i for d in range(dp) for i in per[d, 0]]
    assert len(flat) == 3 * 8 and set(flat) == set(range(n))  # 23 padded to 24: one repeat
    assert len(set(per[0, 0]) & set(per[1, 0])) <= 1
    # epochs reshuffle, the same epoch reproduces
    s = SequenceParallelSampler(n, dp, 0, seed=7)
    s.set_epoch(2)
    assert list(s) == per[0, 0]
    s.set_epoch(3)
    assert list(s) != per[0, 0]
    dl = SequenceParallelSampler(n, dp, 0, drop_last=True)
    assert len(dl) == len(list(dl)) == 7


def test_sampler_resumes_mid_epoch():
    s = SequenceParallelSampler(40, 2, 1, shuffle=True, seed=3)
    s.set_epoch(5)
    it = iter(s)
    first = [next(it) for _ in range(7)]
    state = s.state_dict()
    assert state == {"epoch": 5, "num_consumed": 7}
    rest = list(it)
    resumed = SequenceParallelSampler(40, 2, 1, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(5)  # the usual loop calls set_epoch(epoch) again: the offset is kept
    assert list(resumed) == rest
    assert resumed.state_dict() == {"epoch": 5, "num_consumed": 20}
    whole = SequenceParallelSampler(40, 2, 1, shuffle=True, seed=3)
    whole.set_epoch(5)
    assert first + rest == list(whole) and len(set(first + rest)) == 20
    # An exhausted epoch (also when resumed from a state saved at its very end) moves on to the next.
    fresh = SequenceParallelSampler(40, 2, 1, shuffle=True, seed=3)
    fresh.set_epoch(6)
    epoch6 = list(fresh)
    assert list(resumed) == epoch6 and resumed.state_dict() == {"epoch": 6, "num_consumed": 20}
    at_end = SequenceParallelSampler(40, 2, 1, shuffle=True, seed=3)
    at_end.load_state_dict({"epoch": 5, "num_consumed": 20})
    assert list(at_end) == epoch6
    at_end.set_epoch(9)
    assert at_end.state_dict() == {"epoch": 9, "num_consumed": 0}
    with pytest.raises(seqpar.SeqParError, match="num_consumed"):
        resumed.load_state_dict({"epoch": 0, "num_consumed": 999})


# ----------------------------------------------------------------------------- real meshes, 4 ranks
def _rows_for_spawn() -> list[dict]:
    return make_rows(random.Random(11), 4, [13, 7, 22, 9])


def _spawn_worker() -> dict:
    rows = _rows_for_spawn()
    out = {}
    for name, sp, ring, uly in (("ring4", 4, 4, 1), ("uly4", 4, 1, 4), ("usp", 4, 2, 2), ("dp2_ring2", 2, 2, 1)):
        mesh = seqpar.init_mesh(sp, ring_degree=ring, ulysses_degree=uly)
        indices = list(sp_sampler(len(rows), mesh, shuffle=True, seed=1))
        mine = [rows[i] for i in indices]
        for packing in (False, True):
            col = SequenceParallelCollator(mesh, PAD, packing=packing)
            batch = col(mine)
            full = {k: seqpar.unshard(batch[k], mesh, dim=1).tolist()
                    for k in ("input_ids", "position_ids", "shift_labels")}
            full["cu_seqlens"] = batch["cu_seqlens"].tolist() if packing else None
            full["num_supervised_tokens"] = int(batch["num_supervised_tokens"])
            full["indices"] = indices
            full["multiple"] = seqpar.required_multiple(ring, uly, mesh.effective_layout)
            out[name, packing] = full
    return out


def test_real_meshes_unshard_to_reference():
    results = run_distributed(_spawn_worker, 4, timeout=120)
    rows = _rows_for_spawn()
    for key, res0 in results[0].items():
        for rank, res in enumerate(results):
            r = res[key]
            sp = 2 if key[0] == "dp2_ring2" else 4
            dp_rank = rank // sp
            if dp_rank == 0:
                assert r == res0, (key, rank)  # same rows and same unsharded batch on the SP group
            mine = [rows[i] for i in r["indices"]]
            packing = key[1]
            ref = ref_collate(mine, packing, ref_full_len(mine, packing, r["multiple"]))
            for k in ("input_ids", "position_ids", "shift_labels", "num_supervised_tokens"):
                assert r[k] == ref[k], (key, rank, k)
            if packing:
                assert r["cu_seqlens"] == ref["cu_seqlens"]
    a, b = results[0]["dp2_ring2", False]["indices"], results[2]["dp2_ring2", False]["indices"]
    assert sorted(a + b) == list(range(4))  # dp ranks: different rows, together the dataset
