"""The training loop under SP vs an independent SP=1 single-process reference (same rows per step).

One spawned 4-rank gloo world runs every case of a grid through `seqpar.train.trainer.train`; the
reference for each case runs in the test process with SP=1, no FSDP, playing all dp slots
(`emulate_dp`). Tolerance: max |loss_SP - loss_ref| <= 1e-5 (fp32) at every one of 5 steps, with
lr 1e-2 so that parameter updates feed back into later steps' losses.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from seqpar.testing import run_distributed

WORLD = 4
STEPS = 5
TOL = 1e-5
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def _phrase(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_dist")
    rng = random.Random(0)
    with open(d / "sft.jsonl", "w") as f:
        for _ in range(24):
            f.write(json.dumps({"instruction": _phrase(rng, 1, 6), "response": _phrase(rng, 2, 10)}) + "\n")
    with open(d / "dpo.jsonl", "w") as f:
        for _ in range(24):
            f.write(json.dumps({"prompt": _phrase(rng, 1, 5), "chosen": _phrase(rng, 1, 6),
                                "rejected": _phrase(rng, 2, 8)}) + "\n")
    return d


def _case(data, out, stage="sft", method="full", sp=None, fsdp=False, packing=False, loss_type="sigmoid"):
    sp = sp or {"size": 1}
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(data / f"{stage}.jsonl"), "max_length": 128, "packing": packing},
        "stage": stage,
        "dpo": {"beta": 0.5, "loss_type": loss_type},
        "finetuning": {"method": method, "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "o_proj"]},
        "sequence_parallel": sp,
        "fsdp": fsdp,
        "micro_batch_size": 1 if packing else 2,
        "grad_accum": 2,
        "max_steps": STEPS,
        "optimizer": {"lr": 1e-2},
        "output_dir": str(out),
        "progress": False,
        "seed": 0,
    }


def _train_cases(cases):
    from seqpar.train.config import config_from_dict
    from seqpar.train.trainer import train

    return {name: train(config_from_dict(c)).losses for name, c in cases}


def _reference(case: dict, dp: int) -> list[float]:
    from seqpar.train.config import config_from_dict
    from seqpar.train.trainer import train

    ref = dict(case, sequence_parallel={"size": 1}, fsdp=False, output_dir=case["output_dir"] + "_ref")
    return train(config_from_dict(ref), emulate_dp=dp).losses


def _check(data, tmp_path, grid):
    cases = [(name, _case(data, tmp_path / name, **kw)) for name, kw in grid]
    results = run_distributed(_train_cases, WORLD, cases, timeout=900)
    for name, case in cases:
        losses = results[0][name]
        assert len(losses) == STEPS
        for r in results[1:]:  # every rank logs the same (all-reduced) loss
            assert r[name] == losses
        dp = WORLD // case["sequence_parallel"]["size"]
        ref = _reference(case, dp)
        diff = max(abs(a - b) for a, b in zip(losses, ref))
        assert diff <= TOL, f"{name}: max |dloss| = {diff:.3e} > {TOL} (SP {losses} vs ref {ref})"
        print(f"{name}: max |dloss| = {diff:.2e}")
        assert losses[-1] < losses[0] or case["stage"] == "dpo", f"{name}: loss did not decrease: {losses}"


USP = {"size": 4, "ulysses_degree": 2, "ring_degree": 2}
RING2 = {"size": 2, "ring_degree": 2}
ULY2 = {"size": 2, "ulysses_degree": 2}

FAST_GRID = [
    ("sft_full_usp2x2_packed", dict(sp=USP, packing=True)),
    ("dpo_lora_ring2_dp2_fsdp", dict(stage="dpo", method="lora", sp=RING2, fsdp=True)),
]


def test_train_loop_matches_sp1_reference(data, tmp_path):
    _check(data, tmp_path, FAST_GRID)


def _full_grid():
    grid = []
    for stage, method, (spn, sp), fsdp in itertools.product(
        ("sft", "dpo"), ("full", "lora"), (("sp1", {"size": 1}), ("ring2", RING2), ("ulysses2", ULY2), ("usp2x2", USP)),
        (False, True),
    ):
        for packing in ((False, True) if stage == "sft" else (False,)):
            name = f"{stage}_{method}_{spn}_{'fsdp' if fsdp else 'nofsdp'}_{'packed' if packing else 'padded'}"
            grid.append((name, dict(stage=stage, method=method, sp=sp, fsdp=fsdp, packing=packing)))
    for lt in ("ipo", "simpo"):
        grid.append((f"dpo_full_usp2x2_{lt}", dict(stage="dpo", sp=USP, loss_type=lt)))
    return grid


@pytest.mark.slow
def test_train_loop_full_grid(data, tmp_path):
    _check(data, tmp_path, _full_grid())
