"""Smoke test of `python -m seqpar.bench attention --quick`: JSON schema, and that the bytes seqpar's
collective wrappers count equal the theoretical minimum wherever seqpar should be exactly at it.

One run of the benchmark (two spawned worlds: 4 and 2 gloo ranks) serves every test in this module.
Byte counts are integers: every comparison here is exact.
"""

from __future__ import annotations

import json

import pytest

from seqpar.attention.costs import flops_per_rank, ring_theory, ulysses_theory
from seqpar.bench.__main__ import main
from seqpar.bench.kernel_bound import causal_attention_flops, cpu_ratio_floor


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "attention.json"
    png = out.with_suffix(".png")
    assert (
        main(["attention", "--quick", "--out", str(out), "--png", str(png), "--peers", "none", "--timeout", "240"]) == 0
    )
    assert png.stat().st_size > 0
    return json.loads(out.read_text())


def _case(res, mode, hq, hkv, dtype="float32"):
    (c,) = [
        c
        for c in res["comm_bytes"]["cases"]
        if (c["mode"], c["num_heads"], c["num_kv_heads"], c["dtype"]) == (mode, hq, hkv, dtype)
    ]
    return c


def test_schema(result):
    assert result["benchmark"] == "attention" and result["quick"] is True
    assert {"comm_bytes", "load_balance", "timing", "machine", "elapsed_s"} <= set(result)
    assert result["machine"]["cpu_count"] >= 1 and "shared" in result["machine"]["note"]
    modes = {(c["mode"], c["ulysses_degree"], c["ring_degree"]) for c in result["comm_bytes"]["cases"]}
    assert modes == {("ulysses", 4, 1), ("ring", 1, 4), ("usp", 2, 2)}
    for c in result["comm_bytes"]["cases"]:
        assert set(c["measured_bytes"]) == {"ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd"}
        assert set(c["ratio_vs_plan_heads"]) == set(c["ratio_vs_original_heads"]) == {"fwd", "bwd"}
    t = result["timing"]
    assert set(t["results"]) == {"ulysses", "ulysses_overlap2", "ring", "single_process", "seqpar_one_process"}
    for v in t["results"].values():
        assert len(v["fwd_s"]) == len(v["bwd_s"]) == len(v["cpu_s_max_rank"]) == t["reps"]
        assert v["median_total_s"] > 0 and v["median_cpu_s_sum_ranks"] >= v["median_cpu_s_max_rank"] > 0
    others = {"ulysses", "ulysses_overlap2", "ring", "seqpar_one_process"}
    for prof in t["profile_s"].values():  # where the time goes: the kernel and the exchange are both seen
        assert prof["kernel"] > 0 and prof["all_to_all"] > 0, prof
    assert set(t["speedup_vs_single_process"]) == set(t["cpu_speedup_vs_single_process"]) == others
    assert set(t["best_rep_speedup_vs_single_process"]) == others
    assert result["peers"] == {"deepspeed": None}
    assert all(c["deepspeed"] is None for c in result["comm_bytes"]["cases"])


def test_ranks_count_the_same_unless_head_sets_are_uneven(result):
    for c in result["comm_bytes"]["cases"]:
        even = c["mode"] == "ring" or c["plan"]["sent_heads"] == [c["plan"]["padded_heads"],
                                                                   c["plan"]["expanded_kv_heads"]]
        assert c["same_on_all_ranks"] == even, c
        assert c["other_channels"] == {}, c  # attention itself must not all-gather or all-reduce


def test_wrapper_counts_match_torch_distributed(result):
    # CommStats (seqpar's wrappers) vs bytes counted independently at torch.distributed's entry points, per rank
    for c in result["comm_bytes"]["cases"]:
        assert c["torch_distributed_bytes_per_rank"] == c["measured_per_rank"], c
        mean = {p: sum(r[p] for r in c["measured_per_rank"]) / c["world_size"] for p in ("fwd", "bwd")}
        assert mean == c["totals"]["measured"], c


def test_measured_calls_are_exact(result):
    # The attention whose bytes are counted is also right: fp32 1e-5, bf16 3e-2 (vs a float64 reference).
    for c in result["comm_bytes"]["cases"]:
        tol = 1e-5 if c["dtype"] == "float32" else 3e-2
        assert c["max_abs_err_vs_fp64_reference"] < tol, c


def test_measured_equals_plan_theory_everywhere(result):
    # seqpar's schedule, with the head counts its plan actually moves, is exactly at the formula.
    for c in result["comm_bytes"]["cases"]:
        assert c["measured_bytes"] == c["theory_plan_heads"], c


def test_at_the_minimum_with_original_heads(result):
    # Heads divisible by the Ulysses degree (no dummies, no replication), and every ring forward.
    exact = [("ulysses", 8, 8), ("usp", 8, 8), ("usp", 8, 2), ("usp", 14, 2), ("usp", 6, 6)]
    for mode, hq, hkv in exact:
        c = _case(result, mode, hq, hkv)
        assert c["ratio_vs_original_heads"] == {"fwd": 1.0, "bwd": 1.0}, c
    for c in result["comm_bytes"]["cases"]:
        if c["mode"] == "ring":
            assert c["measured_bytes"]["ring_fwd"] == c["theory_original_heads"]["ring_fwd"], c


def test_independent_formulas(result):
    # Recomputed here by hand (bytes each rank must send), not from the benchmark's own theory fields.
    c = _case(result, "ulysses", 8, 8)
    s, d, p = c["seq_len"], c["head_dim"], 4
    assert c["measured_bytes"]["ulysses_fwd"] == (p - 1) * (s // p) * (8 + 2 * 8 + 8) * d * 4 // p
    c = _case(result, "ring", 8, 2)
    blk = (s // p) * 2 * d
    assert c["measured_bytes"]["ring_fwd"] == (p - 1) * 2 * blk * 4
    # dK/dV reduced in R-1 hops (reduce-scatter): exactly the strict lower bound.
    assert c["measured_bytes"]["ring_bwd"] == (p - 1) * 2 * blk * 4 + (p - 1) * 2 * blk * 4
    assert c["measured_bytes"]["ring_bwd"] == c["ring_bwd_lower_bound_plan_heads"]
    b = _case(result, "ring", 8, 2, "bfloat16")  # K/V travel in bf16, dK/dV in fp32
    assert b["measured_bytes"]["ring_fwd"] == (p - 1) * 2 * blk * 2
    assert b["measured_bytes"]["ring_bwd"] == (p - 1) * 2 * blk * 2 + (p - 1) * 2 * blk * 4
    # 14q/2kv at P=4: the plan has 2 dummy q heads and KV replicated to 4 heads; pure Ulysses sends the 14 real
    # q heads (4, 3, 4, 3 per rank) and the 4 kv replicas: bytes per rank differ, their mean is the formula's
    c = _case(result, "ulysses", 14, 2)
    assert c["plan"] == {"padded_heads": 16, "expanded_kv_heads": 4, "kv_replicas": 2, "dummy_q_heads": 2,
                         "sent_heads": [14, 4]}
    assert c["measured_bytes"]["ulysses_bwd"] == (p - 1) * (s // p) * (14 + 2 * 4 + 14) * d * 4 // p
    assert c["ratio_vs_original_heads"]["fwd"] == pytest.approx(36 / 32)
    c = _case(result, "ulysses", 6, 6)  # 2 dummy kv groups in the plan: not sent at all
    assert c["plan"]["sent_heads"] == [6, 6] and c["ratio_vs_original_heads"]["fwd"] == pytest.approx(1.0)
    # USP 9q/3kv at ulysses 2: the plan pads to 12q/4kv (a dummy kv group), the exchange sends the original
    # 9q/3kv (6q+2kv to one Ulysses rank, 3q+1kv to the other) and the ring moves the 3 kv heads placed
    c = _case(result, "usp", 9, 3)
    assert c["plan"]["padded_heads"] == 12 and c["plan"]["sent_heads"] == [9, 3]
    assert c["ratio_vs_original_heads"] == {"fwd": 1.0, "bwd": 1.0}, c


def test_kernel_bound(result):
    """The kernel-rate figures are present and consistent, the useful-FLOP count matches an explicit count of
    unmasked scores, and each profiled run's floor is its kernel share of the total."""
    kb = result["timing"]["kernel_bound"]
    r = kb["kernel_rate"]
    assert r["shape"]["heads"] == result["timing"]["heads"] // result["timing"]["sp_size"]
    fl = causal_attention_flops(r["shape"]["seq_len"], r["shape"]["heads"], r["shape"]["head_dim"])
    assert r["fwd_gflops"] == pytest.approx(fl["fwd"] / r["fwd_s"] / 1e9)
    assert r["fraction_of_matmul"] == pytest.approx(r["fwd_bwd_gflops"] / r["matmul_gflops"])
    assert r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["matmul_gflops"] > 0
    assert set(kb["cpu_ratio_floor"]) == set(result["timing"]["profile_s"])
    for m, f in kb["cpu_ratio_floor"].items():
        prof = result["timing"]["profile_s"][m]
        assert f["total_s"] == pytest.approx(sum(prof.values())) and f["kernel_s"] == prof["kernel"]
        assert 0 < f["floor"] < 1


def test_causal_flops_count_unmasked_scores():
    import torch

    s, h, d = 7, 3, 4
    unmasked = int(torch.ones(s, s).tril().sum()) * h
    assert causal_attention_flops(s, h, d) == {"fwd": 4 * unmasked * d, "bwd": 10 * unmasked * d}
    assert cpu_ratio_floor({"kernel": 3.0, "copies": 1.0})["floor"] == 0.75


def test_theory_helpers():
    assert ulysses_theory(64, 1, 8, 8, 16, 1, 4) == 0
    assert ring_theory(64, 1, 2, 16, 1, 4) == {"fwd": 0, "bwd": 0, "bwd_min": 0}


def test_load_balance(result):
    rows = result["load_balance"]["planned"]["rows"]
    want = {(deg, lay) for deg in (2, 4, 8) for lay in ("contiguous", "zigzag")}
    assert {(r["ring_degree"], r["layout"]) for r in rows} == want
    for r in rows:
        if r["layout"] == "zigzag":
            assert r["max_over_mean"] == pytest.approx(1.0, abs=1e-12), r
        else:  # (2R-1)/R up to the diagonal's n/2 term
            assert r["max_over_mean"] == pytest.approx(r["expected_max_over_mean"], rel=2e-3), r
    m = result["load_balance"]["measured"]
    for layout, v in m["layouts"].items():
        # The kernel ran exactly the planned work on every rank.
        assert v["executed_flops_per_rank"] == v["planned_flops_per_rank"], layout
        assert v["executed_flops_per_rank"] == flops_per_rank(m["seq_len"], 4, layout, m["heads"], m["head_dim"])
    assert m["layouts"]["zigzag"]["max_over_mean_flops"] == pytest.approx(1.0, abs=1e-12)
    for v in m["layouts"].values():
        assert len(v["predicted_kernel_cpu_s_per_rank"]) == 4 and v["predicted_max_over_mean_cpu"] >= 1.0
    assert {(s["q_len"], s["kv_len"], s["causal"]) for s in m["kernel_shape_cpu_s"]} >= {
        (32, 32, True),
        (32, 64, False),
    }


@pytest.mark.slow
def test_deepspeed_peer_quick(tmp_path):
    # DeepSpeed is the `deepspeed` extra, which `make setup` installs: a missing one fails here, not skips.
    out = tmp_path / "attention.json"
    assert main(["attention", "--quick", "--out", str(out), "--png", "none", "--peers", "deepspeed"]) == 0
    res = json.loads(out.read_text())
    c = _case(res, "ulysses", 8, 8)
    ds = c["deepspeed"]
    # Heads divisible by P: DeepSpeed moves exactly what seqpar moves, and computes the same attention.
    assert ds["measured_bytes"] == {
        "fwd": c["measured_bytes"]["ulysses_fwd"],
        "bwd": c["measured_bytes"]["ulysses_bwd"],
    }
    assert ds["max_abs_diff_vs_seqpar_out_and_grads"] < 1e-5
    assert "deepspeed_ulysses" in res["timing"]["results"]
    for hq, hkv in ((8, 2), (14, 2), (6, 6)):  # each either measured or refused with a recorded reason
        d = _case(res, "ulysses", hq, hkv)["deepspeed"]
        assert ("error" in d) != ("measured_bytes" in d)


# ----------------------------------------------------------------------------- python -m seqpar.bench memory --quick
@pytest.fixture(scope="module")
def memory_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_memory") / "memory.json"
    assert main(["memory", "--quick", "--out", str(out), "--timeout", "300"]) == 0
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_memory_quick_points_are_exact_meter_readings(memory_result):
    from seqpar.bench.memory import FEATURE_SETS

    r = memory_result
    assert r["benchmark"] == "memory" and r["quick"] is True and set(r["models"]) == {"tiny"}
    m = r["models"]["tiny"]
    assert len(m["points"]) == len(m["sp_sizes"]) * len(FEATURE_SETS) * len(m["s_locals"])
    for p in m["points"]:
        assert p["source"] == "tensor_tracker"
        assert p["peak_bytes"] == max(p["per_rank_peak_bytes"]) == sum(p["by_category"].values())
        assert p["full_length"] == p["s_local"] * p["sp"]
        assert 0 < p["activation_bytes"] < p["peak_bytes"]
    for sp in m["sp_sizes"]:
        for fs in FEATURE_SETS:
            pts = sorted((p for p in m["points"] if p["sp"] == sp and p["feature_set"] == fs),
                         key=lambda p: p["s_local"])
            assert pts[0]["peak_bytes"] < pts[-1]["peak_bytes"]  # longer sequence, more activations


def test_memory_quick_fit_max_length_and_confirmation(memory_result):
    m = memory_result["models"]["tiny"]
    budget = memory_result["budget_gib"] * 2**30
    for key, fit in m["fits"].items():
        sp = int(key.split("/")[0][2:])
        pts = [p for p in m["points"] if f"sp{p['sp']}/{p['feature_set']}" == key]
        for p, res in zip(sorted(pts, key=lambda p: p["s_local"]), fit["residuals_bytes"]):
            assert p["peak_bytes"] == pytest.approx(fit["a_bytes"] + fit["b_bytes_per_token"] * p["s_local"] + res)
        ml = m["max_length"][key]
        L, mult = ml["max_full_length"], ml["multiple"]
        assert L % mult == 0
        a, b = fit["a_bytes"], fit["b_bytes_per_token"]
        assert a + b * L / sp <= budget < a + b * (L + mult) / sp
    c = m["confirmation"]
    assert c["sp"] == max(m["sp_sizes"]) and c["full_length"] <= c["cap"]
    # The line through the short runs predicts the peak of a 2-4x longer run (linearity in S_local).
    assert abs(c["rel_error"]) < 0.05
    assert c["measured_peak_bytes"] == c["point"]["peak_bytes"]


def test_memory_quick_sp_splits_activations_and_times(memory_result):
    from seqpar.bench.memory import FEATURE_SETS

    m = memory_result["models"]["tiny"]
    assert set(m["activation_ratio"]) == set(FEATURE_SETS)
    for fs, a in m["activation_ratio"].items():
        assert a["ideal"] == 0.5 and 0 < a["ratio"] < 1, (fs, a)
    # No features: SP=2 holds half the tokens per rank, so about half the activation bytes (plus small
    # per-rank constants). With the features, fixed-size buffers (tiles, chunks) weigh more at these lengths.
    assert 0.45 < m["activation_ratio"]["none"]["ratio"] < 0.65
    far = m["activation_ratio"]["none"]["at_max_length"]  # from the fits, at the SP=1 max trainable length
    assert far["full_length"] == m["max_length"]["sp1/none"]["max_full_length"] and 0.45 < far["ratio"] < 0.65
    for t in m["time"].values():
        assert set(t["ratio_vs_none"]) == set(FEATURE_SETS) and t["ratio_vs_none"]["none"] == 1.0
        assert all(v > 0 for v in t["step_s"].values())


@pytest.mark.slow
def test_step_benchmark_quick(tmp_path):
    """`python -m seqpar.bench step --quick`: SP=1 and SP=2 side by side, every configuration, JSON + PNG."""
    out = tmp_path / "step.json"
    assert main(["step", "--quick", "--out", str(out), "--timeout", "600"]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "step" and res["quick"] is True
    assert set(res["sp2_over_sp1_tokens_per_s"]) == {"lora/none", "lora/memory", "full/none", "full/memory"}
    for key, p in res["points"].items():
        assert p["tokens_per_step"] == res["seq_len"] and p["tokens_per_s"] > 0, (key, p)
        assert p["mesh"] == ("ulysses=1 ring=1" if key.endswith("sp1") else "ulysses=2 ring=1"), (key, p)
        assert len(p["step_cpu_s"]) == len(p["step_s"]) and p["best_step_cpu_s"] == min(p["step_cpu_s"]) > 0, p
    for key, ratio in res["sp1_over_sp2_step_cpu_s"].items():  # the CPU view of the same pairs
        want = res["points"][f"{key}/sp1"]["best_step_cpu_s"] / res["points"][f"{key}/sp2"]["best_step_cpu_s"]
        assert ratio == pytest.approx(want) and ratio > 0
    assert res["profile_per_step_s"]["sp2"]["collectives"] > 0 and "loadavg_start" in res["machine"]
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_recurrent_benchmark_quick(tmp_path):
    """`python -m seqpar.bench recurrent --quick`: every layer x SP size x mode timed, and the bytes seqpar's
    counters saw agree with the planner's (planner.recurrent) up to the documented factors: the planner adds the
    all-gathers' backward reduce-scatters, and its chain state bytes are the whole chain's
    2R-2 hops (each rank's critical path), the sum of what the ranks send."""
    out = tmp_path / "recurrent.json"
    assert main(["recurrent", "--quick", "--out", str(out), "--timeout", "600"]) == 0
    res = json.loads(out.read_text())
    assert res["benchmark"] == "recurrent" and res["seq_len"] == 64
    seen = {(p["layer"], p["sp"], p["mode"]) for p in res["points"]}
    assert len(seen) == len(res["points"]) == 2 * (4 + 5)
    for p in res["points"]:
        assert p["seconds"] > 0 and len(p["bytes_per_rank"]) == p["sp"], p
        sent = p["bytes_per_rank"][0]
        drop = ("state_fwd", "state_bwd")  # the chain: the ends of the zigzag order send one state, the others two
        assert all({k: v for k, v in b.items() if k not in drop} == {k: v for k, v in sent.items() if k not in drop}
                   for b in p["bytes_per_rank"]), p  # otherwise every rank sends alike
        if p["mode"] == "sp1":
            assert sent == {} and "planner_bytes" not in p
            continue
        plan, r = p["planner_bytes"], p["ring"]
        if p["ulysses"] > 1:
            assert plan["ulysses_recurrent"] == sent["ulysses_fwd"] + sent["ulysses_bwd"], p
        if r > 1:
            gathered = sent["all_gather"]
            if p["mode"] == "ring-scan":
                assert plan["halo"] + plan["state"] == 2 * gathered, p
            else:  # chain (ring or USP): backward sends what forward did; the planner: the chain's hops, both passes
                chain = sum(b["state_fwd"] for b in p["bytes_per_rank"]) // (p["sp"] // r)  # per ring group
                assert all(b["state_bwd"] == b["state_fwd"] > 0 for b in p["bytes_per_rank"]), p
                assert plan["state"] == 2 * chain, p
                assert plan["halo"] == 2 * gathered, p


def test_sp_step_profile_runs_on_cpu():
    """bench.gpu_sp's code on the CPU (its GPU run is `python -m seqpar.bench gpu --parts sp`): a world of 1, a
    Ulysses-4 and a ring-4 step as threads, their ops' time by category; the threaded collectives are attributed to
    communication, the attention ops to attention."""
    from seqpar.bench.gpu_sp import categorise, sp_lines, sp_rows
    from seqpar.threaded import COMM_RANGE

    assert categorise("aten::copy_", [COMM_RANGE, "x"]) == "communication"
    assert categorise("aten::_scaled_dot_product_cudnn_attention", []) == "attention"
    assert categorise("aten::cat", []) == "copies_layout" and categorise("aten::sigmoid", []) == "merge_other"
    rows = sp_rows(s=64, modes=((1, 1), (4, 1), (1, 4)), reps=1, device="cpu")
    assert all("error" not in r for r in rows), rows
    assert all(r["gpu_ms"]["attention"] > 0 for r in rows)
    assert rows[0]["gpu_ms"]["communication"] == 0 and all(r["gpu_ms"]["communication"] > 0 for r in rows[1:])
    assert "sp_overhead_ms_vs_world1" in rows[1] and len(sp_lines(rows)) == 3


@pytest.mark.slow
def test_dynamic_benchmark_quick(tmp_path):
    """`python -m seqpar.bench dynamic --quick`: fixed, fixed packed and dynamic on 4 ranks, the per-round ratios,
    the plan's degrees and rank times; the planner's predictions for 8 H100 / 8 H200; JSON + PNG."""
    out = tmp_path / "dynamic.json"
    assert main(["dynamic", "--quick", "--out", str(out), "--timeout", "600"]) == 0
    res = json.loads(out.read_text())
    m = res["measured"]
    assert res["benchmark"] == "dynamic" and set(m["runs"]) == {"fixed", "fixed_packed", "dynamic"}
    assert all(r["tokens_per_s"] > 0 for runs in m["runs"].values() for r in runs)
    dyn = m["runs"]["dynamic"][0]
    assert len({d for row in dyn["sp_degrees"] for d in row}) >= 2 and all(x > 0 for x in dyn["predicted_rank_s_max"])
    per = m["dynamic_over_fixed"]["per_round"]
    assert per[0] == pytest.approx(dyn["tokens_per_s"] / m["runs"]["fixed"][0]["tokens_per_s"])
    cpu = m["dynamic_over_fixed_packed_cpu_time"]["per_round"]  # by CPU time too: the work, whatever the load
    assert cpu[0] == pytest.approx(dyn["tokens_per_cpu_s"] / m["runs"]["fixed_packed"][0]["tokens_per_cpu_s"])
    for gpu in ("h100", "h200"):
        p = res["predicted"][gpu]
        assert p["tokens_per_s"]["dynamic"] > 0 and p["max_local_tokens"] <= p["memory_max_local_tokens"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_rollout_engines_refused_without_vllm(tmp_path):
    """`rollout --engines` (transformers vs vLLM, tests/vllm_env runs it) where vLLM is not installed: one
    SeqParError naming the vLLM venv, before any rank starts or anything is written."""
    from seqpar.errors import SeqParError
    from seqpar.hf.vllm_models import vllm_available

    if vllm_available():
        pytest.skip("vLLM is installed here: tests/vllm_env/test_bench_rollout_engines.py runs the benchmark")
    with pytest.raises(SeqParError, match="make vllm-env"):
        main(["rollout", "--engines", "--quick", "--out", str(tmp_path / "engines.json")])
    assert not (tmp_path / "engines.json").exists()
