"""Length-aware SP's cost model and scheduler (seqpar.dynamic), pure Python: no processes.

- RowCost IS the planner's time model per micro-batch: for one row of L tokens at degree d, its seconds plus
  the step's constants equal planner.time.estimate_time's step time (exactly on a cluster without overlap;
  hybrids within 0.2%: their conv halo scales with rows, which RowCost counts per token);
- the scheduler's plans are valid whatever the mix (every row once, at most max_local_tokens per rank, aligned
  groups, one slot per rank and micro-step, a row at the smallest degree that holds it) and balanced (within
  15% of a lower bound on the step's time);
- a packed row under a ring orders its documents so that no rank holds most of the attention.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from seqpar.dynamic.cost import RowCost
from seqpar.dynamic.schedule import Row, Scheduler
from seqpar.errors import SeqParError
from seqpar.planner.dynamic import degree_needed, row_cost, step_constant_s, world_degrees
from seqpar.planner.gpus import make_cluster
from seqpar.planner.memory import Features, Layout, Workload
from seqpar.planner.model import load_model_facts
from seqpar.planner.time import estimate_time

NO_OVERLAP = dict(overlap=False, host_layer_s=1e-4, attn_by_len=((256, 50.0), (8192, 400.0)))


@pytest.mark.parametrize("name,kw,stage,ft,feats", [
    ("llama-3.1-8b", None, "sft", "full", Features(fused_loss=True)),
    ("llama-3.1-8b", None, "dpo", "full", Features(activation_checkpointing=True, fused_loss=True, fsdp=True)),
    ("tiny:llama", {"num_heads": 4, "num_kv_heads": 2}, "sft", "lora", Features(activation_checkpointing=True)),
    ("tiny:qwen3_5", {}, "sft", "full", Features(fused_loss=True)),
])
def test_row_cost_is_the_planner_time_model(name, kw, stage, ft, feats):
    m = load_model_facts(name, kw)
    cl = replace(make_cluster(8, gpu="h100"), **NO_OVERLAP)
    wl = Workload(0, stage, ft, "bf16")
    degs = world_degrees(m, 8)
    assert any(r > 1 for _, r in degs.values()) or name.startswith("llama")  # a ring degree where kv heads are few
    rc = row_cost(m, wl, feats, cl, degs, 8)
    tol = 2e-3 if m.recurrent is not None else 1e-12
    for d, (u, r) in degs.items():
        for length in (2 * u * r * 300, 2 * u * r * 4096):
            te = estimate_time(m, replace(wl, seq_len=length), Layout(u, r, 8 // d), feats, cl)
            rows = [[length]] * (2 if stage == "dpo" else 1)
            mine = rc.seconds(rows, d, packed=False) + step_constant_s(m, wl, Layout(u, r, 8 // d), feats, cl)
            assert abs(mine / te.step_s - 1) <= tol, (name, d, length, mine, te.step_s)


def _cost(world: int = 8, **cluster) -> tuple[RowCost, dict]:
    m = load_model_facts("tiny:llama", {"num_heads": 4, "num_kv_heads": 2, "num_layers": 4})
    cl = replace(make_cluster(world, gpu="h100"), **cluster)
    degs = world_degrees(m, world)
    return row_cost(m, Workload(0, "sft", "full", "fp32"), Features(fused_loss=True), cl, degs, world), degs


def _long_tail(rng: random.Random, n: int, top: int) -> list[Row]:
    rows = []
    for i in range(n):
        x = rng.random()
        length = rng.randint(16, top // 8) if x < 0.85 else rng.randint(top // 8, top // 2) if x < 0.97 \
            else rng.randint(top // 2, top)
        rows.append(Row(i, length))
    return rows


@pytest.mark.parametrize("packed,lockstep", [(True, False), (True, True), (False, False), (False, True)])
def test_plans_are_valid(packed, lockstep):
    rc, degs = _cost(**NO_OVERLAP)
    n = 1024
    sch = Scheduler(rc, 8, n, list(degs), packed=packed)
    rng = random.Random(1)
    for _ in range(6):
        rows = _long_tail(rng, 48, 8 * n)
        plan = sch.plan(rows, lockstep=lockstep)
        seen = sorted(r.index for s in plan.slots for r in s.rows)
        assert seen == list(range(len(rows)))
        for s in plan.slots:
            assert s.first % s.degree == 0 and s.first + s.degree <= 8
            assert sch.tokens(s.rows, s.degree) <= n
            need = max(sch.degree_of(r) for r in s.rows)
            assert s.degree == need or (packed and need == 1), (s.degree, need)
            assert len(s.rank_s) == s.degree
        for k in range(plan.micro_steps):
            ranks = [r for s in plan.slots if s.micro_step == k for r in s.ranks]
            assert len(ranks) == len(set(ranks))
        used = plan.degrees
        assert sum(used.values()) == len(rows) and len(used) >= 2


def test_plans_are_balanced():
    """Within 15% of a lower bound: the work of every row alone on one rank of its degree / world, or the
    longest single slot."""
    rc, degs = _cost(**NO_OVERLAP)
    n = 1024
    sch = Scheduler(rc, 8, n, list(degs), packed=True)
    rng = random.Random(2)
    for _ in range(4):
        rows = _long_tail(rng, 96, 8 * n)
        plan = sch.plan(rows)
        work = sum(sum(sch.slot_rank_s([r], sch.degree_of(r))[1]) for r in rows)
        bound = max(work / 8, max(s.seconds for s in plan.slots if len(s.rows) == 1))
        assert max(plan.finish()) <= 1.15 * bound, (max(plan.finish()), bound)


def test_ring_packed_row_is_balanced_by_documents():
    """One long document and short ones in a ring slot: the order the scheduler picks gives the ring ranks more
    even attention than the long document first (what token balance alone would accept)."""
    rc, degs = _cost(**NO_OVERLAP)
    d = next(d for d, (u, r) in degs.items() if r > 1)
    sch = Scheduler(rc, 8, 4096, list(degs), packed=True)
    rows = [Row(0, 2000)] + [Row(i, 100) for i in range(1, 11)]
    order, rank_s = sch.slot_rank_s(rows, d)
    naive = rc.rank_seconds([[r.length for r in rows]], d)
    assert max(rank_s) < max(naive)
    assert max(rank_s) / min(rank_s) < max(naive) / min(naive)


def test_degree_needed_and_refusal():
    degs = {1: (1, 1), 2: (2, 1), 4: (2, 2)}
    assert degree_needed(100, 1, degs, 128) == 1
    assert degree_needed(200, 1, degs, 128) == 2
    assert degree_needed(400, 1, degs, 128) == 4
    assert degree_needed(200, 2, degs, 128) == 4  # a DPO pair: two rows
    with pytest.raises(SeqParError, match="max_local_tokens=128"):
        degree_needed(600, 1, degs, 128)


def test_plan_lengths_command(capsys, tmp_path):
    """`seqpar plan --lengths`: fixed vs dynamic on a histogram and on a JSONL file of rows; --json; the proposed N
    holds the longest row at the largest degree and fits the memory bound."""
    import json

    from seqpar.cli.main import main

    args = ["plan", "--model", "tiny:llama", "--gpus", "4", "--gpu", "h100", "--sample-rows", "256",
            "--rows-per-step", "16", "--lengths", "0.9:64-512,0.09:512-2048,0.01:4096"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "size: dynamic, max_local_tokens" in out and "fixed SP" in out
    assert main(args + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["max_local_tokens"] <= res["memory_max_local_tokens"]
    assert res["tokens_per_s"]["dynamic"] > 0 and res["tokens_per_s"]["fixed"] > 0
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1] * n}) + "\n" for n in [50, 70, 900, 30, 4000, 20] * 8))
    assert main(["plan", "--model", "tiny:llama", "--gpus", "4", "--rows-per-step", "6", "--lengths", str(rows),
                 "--max-local-tokens", "1024", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["max_local_tokens"] == 1024 and res["rows"] == 48 and res["steps"] == 8
    assert len(res["sp_degrees"]) >= 2, res["sp_degrees"]  # the 4000-token rows need more than one rank


def test_memory_refusal(tmp_path):
    """size: dynamic with a device memory known: an N the memory model does not fit is refused, naming the largest
    that fits; that one is accepted."""
    from dynamic_cases import DYNAMIC, sft_case, write_sft

    from seqpar.planner.dynamic import check_config_memory
    from seqpar.train.config import config_from_dict

    base = sft_case(write_sft(tmp_path / "sft.jsonl"), tmp_path / "run", DYNAMIC)
    big = config_from_dict({**base, "dataset": {**base["dataset"], "max_length": 2**20},
                            "sequence_parallel": {"size": "dynamic", "max_local_tokens": 2**18}})
    with pytest.raises(SeqParError, match=r"fits at most (\d+) tokens per rank") as e:
        check_config_memory(big, 4, 64 * 2**20 + 2 * 2**30 + 2**28)
    import re

    top = int(re.search(r"fits at most (\d+)", str(e.value)).group(1))
    assert 0 < top < 2**18
    ok = config_from_dict({**base, "dataset": {**base["dataset"], "max_length": 4 * top},
                           "sequence_parallel": {"size": "dynamic", "max_local_tokens": top}})
    assert check_config_memory(ok, 4, 64 * 2**20 + 2 * 2**30 + 2**28) == top
