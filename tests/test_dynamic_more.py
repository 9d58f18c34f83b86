"""Length-aware SP beyond the plain equivalence (tests/test_dynamic_train.py): resuming a dynamic run's checkpoint
at a fixed size and the reverse (on the uninterrupted fixed run's trajectory), the memory bound (the dynamic
run's peak live bytes per rank are at most the fixed run's at the same N), a hybrid model (Gated DeltaNet) and a
vision-language model with images, and the refusals before any process group.

4 gloo ranks, fp32, SGD lr 0.5; tolerances as in test_dynamic_train.py (1e-5 on loss, gradient norm and final
parameters)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dynamic_cases import DYNAMIC, FIXED, compare, sft_case, train_cases, write_sft

from seqpar.errors import SeqParError
from seqpar.spawn import run_distributed

TOL = 1e-5


# The memory pair: a row of max_length (32 tokens per rank at size 4) as the second micro-batch of a step, when the
# first one's gradients exist: the fixed run's worst moment at N = 32, which the dynamic run's slots must not pass.
MEM_LENGTHS = [20, 128, 50, 12, 10, 25, 18, 60, 8, 30, 14, 22, 40, 120, 9, 28]


def _resume_cases(d: Path, sft: Path) -> list[tuple]:
    """Uninterrupted fixed run (4 steps); dynamic 2 steps -> fixed 2 more; fixed 2 -> dynamic 2 more; the memory
    pair."""
    mem = write_sft(d / "mem.jsonl", lengths=MEM_LENGTHS)
    def run(out: str, sp: dict, steps: int, every: int = 0) -> dict:
        c = sft_case(sft, d / out, sp, steps=steps)
        c["checkpoint"] = {"save_final": True, "every": every}
        return c

    return [("whole", run("whole", FIXED, 4)),
            ("d2f_a", run("d2f", DYNAMIC, 2, every=2)), ("d2f_b", run("d2f", FIXED, 4)),
            ("f2d_a", run("f2d", FIXED, 2, every=2)), ("f2d_b", run("f2d", DYNAMIC, 4)),
            ("mem_fixed", sft_case(mem, d / "mem_fixed", FIXED, steps=2, measure=True)),
            ("mem_dyn", sft_case(mem, d / "mem_dyn", DYNAMIC, steps=2, measure=True)),
            ("eval_fixed", _with_eval(run("eval_fixed", FIXED, 2), mem)),
            ("eval_dyn", _with_eval(run("eval_dyn", DYNAMIC, 2), mem))]


def _with_eval(case: dict, rows: Path) -> dict:
    return {**case, "eval_dataset": {"path": str(rows), "format": "tokenized", "max_length": 128}, "eval_every": 1}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamic_more")
    cases = _resume_cases(d, write_sft(d / "sft.jsonl"))
    return d, run_distributed(train_cases, 4, cases, timeout=560)


@pytest.mark.parametrize("first,second", [("d2f_a", "d2f_b"), ("f2d_a", "f2d_b")])
def test_resume_between_dynamic_and_fixed(world, first, second):
    d, results = world
    r = results[0]
    resumed = r[second]  # metrics.jsonl keeps the first launch's rows up to its checkpoint, then the resumed ones
    assert [row["step"] for row in resumed] == [1, 2, 3, 4]
    assert ("sp_degrees" in resumed[0]) == (first == "d2f_a") and ("sp_degrees" in resumed[3]) == (first == "f2d_a")
    dloss, dgn = compare(r["whole"], resumed, TOL)
    folder = "d2f" if first == "d2f_a" else "f2d"
    got, want = torch.load(d / folder / "final_state.pt"), torch.load(d / "whole" / "final_state.pt")
    dparam = max(float((got[k] - want[k]).abs().max()) for k in want)
    print(f"{first} -> {second}: |dloss| {dloss:.2e}, |dgn| {dgn:.2e}, |dparam| {dparam:.2e}")
    assert dparam <= TOL, dparam


def test_memory_at_most_the_fixed_runs(world):
    """Peak live tensor bytes per rank (the exact meter, max over ranks and steps): the dynamic run packs short rows
    up to N tokens per rank, never more, so it stays within what the fixed run at the same N needs for a row of
    max_length after another micro-batch (1% slack for the meter's per-step bookkeeping)."""
    _, results = world
    fixed = max(row["peak_alloc_mb"] for row in results[0]["mem_fixed"])
    dyn = max(row["peak_alloc_mb"] for row in results[0]["mem_dyn"])
    print(f"peak_alloc_mb: fixed {fixed:.3f}, dynamic {dyn:.3f}")
    assert dyn <= fixed * 1.01, (dyn, fixed)


# ----------------------------------------------------------------------------- refusals (no processes)
def _cfg(tmp_path: Path, **over) -> dict:
    sft = write_sft(tmp_path / "sft.jsonl")
    c = sft_case(sft, tmp_path / "run", DYNAMIC)
    for k, v in over.items():
        c[k] = v
    return c


@pytest.mark.parametrize("over,match", [
    ({"sequence_parallel": {"size": "dynamic", "max_local_tokens": 16}}, "max_local_tokens=16 cannot hold a row of"),
    ({"sequence_parallel": {"size": "dynamic"}}, "needs max_local_tokens"),
    ({"sequence_parallel": {"size": "dynamic", "max_local_tokens": 32, "ulysses_degree": 2}}, "per degree"),
    ({"grad_sync": "overlap"}, "grad_sync: overlap"),
])
def test_refused_before_launch(tmp_path, over, match):
    from seqpar.train.config import config_from_dict
    from seqpar.train.lifecycle.launch import prelaunch_checks

    with pytest.raises(SeqParError, match=match):
        prelaunch_checks(config_from_dict(_cfg(tmp_path, **over)), 4)


def test_packing_refused(tmp_path):
    from seqpar.train.config import config_from_dict

    c = _cfg(tmp_path)
    c["dataset"] = {**c["dataset"], "packing": True}
    with pytest.raises(SeqParError, match="packs the short rows itself"):
        config_from_dict(c)


def test_check_command_accepts_dynamic(tmp_path):
    """`seqpar check` on a dynamic config: the world it would run at, the steps."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.lifecycle.launch import prelaunch_checks

    stats = prelaunch_checks(config_from_dict(_cfg(tmp_path)), 4)
    assert stats["examples"] == 24 and stats["max_steps"] == 3


# ----------------------------------------------------------------------------- hybrid and vision-language models
@pytest.fixture(scope="module")
def model_world(tmp_path_factory):
    from dynamic_cases import write_vlm

    d = tmp_path_factory.mktemp("dynamic_models")
    sft = write_sft(d / "sft.jsonl")
    vlm = write_vlm(d)
    hybrid = {"name": "tiny:qwen3_5", "kwargs": {"num_layers": 2}}
    cases = []
    for name, sp in (("fixed", FIXED), ("dyn", DYNAMIC)):
        cases.append((f"hybrid_{name}", sft_case(sft, d / f"hybrid_{name}", sp, steps=2, model=hybrid)))
        for fsdp in (False, True):  # under FSDP2 the vision tower joins on every rank (idle ranks' dummies too)
            tag = f"vlm{'_fsdp' if fsdp else ''}_{name}"
            c = sft_case(vlm, d / tag, sp, steps=3, model={"name": "tiny:qwen2_5_vl"}, fsdp=fsdp)
            c["dataset"] = {"path": str(vlm), "max_length": 128, "shuffle": False}
            cases.append((tag, c))
    return run_distributed(train_cases, 4, cases, timeout=560)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "vlm", "vlm_fsdp"])
def test_hybrid_and_vlm(model_world, name):
    """A hybrid (tiny Qwen3.5: Gated DeltaNet layers passing state across the ring at degree 4) and a VLM (tiny
    Qwen2.5-VL, rows with 0-2 images; also under FSDP2): equal to the fixed run (loss, gradient norm) at several
    degrees."""
    r = model_world[0]
    dloss, dgn = compare(r[f"{name}_fixed"], r[f"{name}_dyn"], TOL)
    used = {int(k) for row in r[f"{name}_dyn"] for k in row["sp_degrees"]}
    print(f"{name}: |dloss| {dloss:.2e}, |dgn| {dgn:.2e}, degrees {used}")
    assert len(used) >= 2, used


@pytest.mark.slow
def test_seqpar_verify_dynamic(tmp_path):
    """`seqpar verify --nproc-per-node 4` of a size: dynamic config (the CLI under torchrun end to end): losses,
    gradient norms and the step-1 gradient equal the SP=1 reference's, which plays the fixed run's dp slots."""
    from procs import run_verify

    cfg = sft_case(write_sft(tmp_path / "sft.jsonl"), tmp_path / "run", DYNAMIC, steps=2)
    cfg["checkpoint"] = {"save_final": False}
    rep = run_verify(cfg, tmp_path, steps=2, nproc=4)
    assert rep["passed"] and rep["max_abs_dloss"] <= TOL and rep["grads_passed"], rep
    assert rep["dp_size"] == 1, rep


def test_eval_after_dynamic_steps(world):
    """An eval set after each step runs as the fixed run at the largest degree would (the model goes back to that
    mesh after the step's slots): the same eval losses as the fixed run's."""
    _, results = world
    ev = [[row["eval_loss"] for row in results[0][k] if "eval_loss" in row] for k in ("eval_fixed", "eval_dyn")]
    assert len(ev[0]) == len(ev[1]) == 2, ev
    assert max(abs(a - b) for a, b in zip(*ev)) <= TOL, ev


def test_one_process(tmp_path):
    """size: dynamic in a single process (every row at degree 1, packed): the SP=1 run's losses."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    sft = write_sft(tmp_path / "sft.jsonl")
    want = train(config_from_dict(sft_case(sft, tmp_path / "fixed", {"size": 1}, steps=2))).losses
    got = train(config_from_dict(sft_case(sft, tmp_path / "dyn", {"size": "dynamic", "max_local_tokens": 128},
                                          steps=2))).losses
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want)) <= TOL, (got, want)
