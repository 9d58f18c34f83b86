"""The training loop under SP vs an independent SP=1 single-process reference (same rows per step).

One spawned 4-rank gloo world runs every case of a grid through `seqpar.train.run.train`; the
reference for each case runs in the test process with SP=1, no FSDP, playing all dp slots
(`emulate_dp`). Tolerance: max |loss_SP - loss_ref| <= 1e-5 (fp32) at every one of 5 steps, with
lr 1e-2 so that parameter updates feed back into later steps' losses.

That reference shares the trainer's normalisation code, and AdamW is blind to a constant gradient
scale; so SGD cases (a scale error moves the SGD loss) are also compared with a plain-PyTorch loop
written here: the unsharded HF model, textbook token-mean CE over the global step (sum of CE over every
supervised token of all micro-batches of all dp ranks / their count), `torch.optim.SGD`. Parameters
after 3 steps and the logged losses must agree within 1e-5 (fp32).
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from procs import phrase

from seqpar.spawn import run_distributed

WORLD = 4
STEPS = 5
TOL = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_dist")
    rng = random.Random(0)
    with open(d / "sft.jsonl", "w") as f:
        for _ in range(24):
            f.write(json.dumps({"instruction": phrase(rng, 1, 6), "response": phrase(rng, 2, 10)}) + "\n")
    with open(d / "dpo.jsonl", "w") as f:
        for _ in range(24):
            f.write(json.dumps({"prompt": phrase(rng, 1, 5), "chosen": phrase(rng, 1, 6),
                                "rejected": phrase(rng, 2, 8)}) + "\n")
    return d


def _case(data, out, stage="sft", method="full", sp=None, fsdp=False, packing=False, loss_type="sigmoid",
          optimizer=None, steps=STEPS, shuffle=True, save_final=False, grad_sync="auto"):
    sp = sp or {"size": 1}
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(data / f"{stage}.jsonl"), "max_length": 128, "packing": packing, "shuffle": shuffle},
        "stage": stage,
        "dpo": {"beta": 0.5, "loss_type": loss_type},
        "finetuning": {"method": method, "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "o_proj"]},
        "sequence_parallel": sp,
        "fsdp": fsdp,
        "micro_batch_size": 1 if packing else 2,
        "grad_accum": 2,
        "grad_sync": grad_sync,
        "max_steps": steps,
        "optimizer": optimizer or {"lr": 1e-2},
        "checkpoint": {"save_final": save_final},
        "output_dir": str(out),
        "progress": False,
        "seed": 0,
    }


def _train_cases(cases, env=None):
    """Each (name, config[, env]) through train(); env (the world's) and a case's own env: test-only fault hooks
    (seqpar.train.loop.grads), a case's only for that case."""
    import os
    from unittest import mock

    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    os.environ.update(env or {})
    out = {}
    for name, c, *case_env in cases:
        with mock.patch.dict(os.environ, case_env[0] if case_env else {}):
            out[name] = train(config_from_dict(c)).losses
    return out


def _reference(case: dict, dp: int) -> list[float]:
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    ref = dict(case, sequence_parallel={"size": 1}, fsdp=False, output_dir=case["output_dir"] + "_ref")
    return train(config_from_dict(ref), emulate_dp=dp).losses


def _check(data, tmp_path, grid, results=None):
    cases = [(name, _case(data, tmp_path / name, **kw)) for name, kw in grid]
    results = results or run_distributed(_train_cases, WORLD, cases, timeout=540)
    for name, case in cases:
        losses = results[0][name]
        assert len(losses) == case["max_steps"]
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
# SGD (a gradient-scale error moves its loss): dp 2 x sp 2, grad_accum 2 x 2 rows, unshuffled so the
# plain loop below can take the same rows; 3 steps = one epoch of the 24 rows.
SGD = dict(optimizer={"name": "sgd", "lr": 0.5}, steps=3, shuffle=False, save_final=True)
# The second: replicated parameters whose sp sums are posted during the last backward (grad_sync: overlap; on a
# CPU "auto" sums after backward, which the no-FSDP cases above and below run), the dp sum after it.
SGD_FAST = [("sft_full_ring2_dp2_fsdp_sgd", dict(sp=RING2, fsdp=True, **SGD)),
            ("sft_full_uly2_dp2_overlap_sgd", dict(sp=ULY2, grad_sync="overlap", **SGD))]
# The same SGD runs with the SP side's gradients scaled by dp x sp = 4 (a test-only fault, for that case only):
# the plain-loop comparison must fail by far (the FSDP path and the plain all-reduce path).
FAULT = {"SEQPAR_FAULT_GRAD_SCALE": "4"}
FAULT_FAST = [("fault4_sft_full_ring2_dp2_fsdp_sgd", dict(sp=RING2, fsdp=True, **SGD)),
              ("fault4_sft_full_usp2x2_nofsdp_sgd", dict(sp=USP, **SGD))]


@pytest.fixture(scope="module")
def fast_world(data, tmp_path_factory):
    """One spawned 4-rank world for every fast case of this module."""
    root = tmp_path_factory.mktemp("fast_world")
    cases = [(name, _case(data, root / name, **kw)) for name, kw in FAST_GRID + SGD_FAST]
    cases += [(name, _case(data, root / name, **kw), FAULT) for name, kw in FAULT_FAST]
    return root, run_distributed(_train_cases, WORLD, cases, timeout=540)


def test_train_loop_matches_sp1_reference(data, fast_world):
    root, results = fast_world
    _check(data, root, FAST_GRID + SGD_FAST, results)


def _plain_sgd_loop(case: dict, dp: int) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    """Textbook reference: unsharded HF model, token-mean CE over the global step, torch.optim.SGD.

    Rows: dp rank d reads rows d, d + dp, ... (SequenceParallelSampler without shuffle); each step takes
    grad_accum x micro_batch_size of them per dp rank. Returns (losses, final parameters, supervised
    token count of every micro-batch).
    """
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(case)
    examples, _ = prepare_examples(cfg)
    per_step = cfg.grad_accum * cfg.micro_batch_size
    assert len(examples) % dp == 0 and cfg.max_steps * per_step <= len(examples) // dp  # no epoch wrap to model
    torch.manual_seed(cfg.seed)
    model = load_model(cfg).train()  # plain HF attention over the full sequence
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr)
    losses, micro_counts = [], []
    for step in range(cfg.max_steps):
        ce_sum, count = torch.zeros(()), 0
        for d in range(dp):
            mine = examples[d::dp][step * per_step:(step + 1) * per_step]
            for j in range(cfg.grad_accum):
                micro_count = 0
                for ex in mine[j * cfg.micro_batch_size:(j + 1) * cfg.micro_batch_size]:
                    logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0, :-1]
                    labels = torch.tensor(ex["labels"][1:])
                    ce_sum = ce_sum + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100,
                                                                        reduction="sum")
                    micro_count += int((labels != -100).sum())
                micro_counts.append(micro_count)
                count += micro_count
        loss = ce_sum / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, micro_counts


def _check_vs_plain_loop(root, name, losses, case, tol=TOL):
    dp = WORLD // case["sequence_parallel"]["size"]
    ref_losses, ref_params, counts = _plain_sgd_loop(case, dp)
    assert len(set(counts)) > 1, counts  # uneven supervised counts across micro-batches / dp ranks
    sp_params = torch.load(root / name / "final_state.pt")
    assert set(ref_params) <= set(sp_params), sorted(set(ref_params) - set(sp_params))[:3]
    dparam = max(float((sp_params[k] - ref_params[k]).abs().max()) for k in ref_params)
    dloss = max(abs(a - b) for a, b in zip(losses, ref_losses))
    moved = max(float((ref_params[k] - v).abs().max()) for k, v in _initial_params(case).items())
    print(f"{name} vs plain SGD loop: max |dloss| = {dloss:.2e}, max |dparam| = {dparam:.2e} "
          f"(params moved {moved:.2e})")
    return dloss, dparam, moved


def _initial_params(case: dict) -> dict[str, torch.Tensor]:
    from seqpar.train.config import config_from_dict
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(case)
    torch.manual_seed(cfg.seed)
    return dict(load_model(cfg).named_parameters())


def test_train_loop_matches_plain_pytorch_sgd(data, fast_world):
    """dp 2 x sp 2, grad_accum 2, SGD lr 0.5, 3 steps, under FSDP2 (zigzag ring) and with overlapped gradient
    sums (Ulysses): parameters and logged losses equal the plain-PyTorch loop's within 1e-5 (a gradient-scale
    error moves both far past that)."""
    root, results = fast_world
    for name, kw in SGD_FAST:
        dloss, dparam, moved = _check_vs_plain_loop(root, name, results[0][name], _case(data, root / name, **kw))
        assert dloss <= TOL and dparam <= TOL, (name, dloss, dparam)
        assert moved > 1e-2, moved  # the steps really changed the parameters


def _assert_fault_seen(root, names_kw, results, data) -> None:
    for name, kw in names_kw:
        dloss, dparam, _ = _check_vs_plain_loop(root, name, results[0][name], _case(data, root / name, **kw))
        assert dloss > 100 * TOL and dparam > 100 * TOL, (name, dloss, dparam)


def test_plain_pytorch_sgd_check_sees_gradient_scale_fault_fast(data, fast_world):
    """Fast twin of the slow test below, in the fast world (the fault set for those two cases only)."""
    root, results = fast_world
    _assert_fault_seen(root, FAULT_FAST, results, data)


@pytest.mark.slow
def test_plain_pytorch_sgd_check_sees_gradient_scale_fault(data, tmp_path):
    """The same SGD comparisons (FSDP and plain all-reduce paths) with the SP run's gradients scaled by
    dp x sp = 4 (test-only env fault, for the whole world): both must fail by far."""
    grid = [("sft_full_ring2_dp2_fsdp_sgd", dict(sp=RING2, fsdp=True, **SGD)),
            ("sft_full_usp2x2_nofsdp_sgd", dict(sp=USP, **SGD))]
    cases = [(name, _case(data, tmp_path / name, **kw)) for name, kw in grid]
    results = run_distributed(_train_cases, WORLD, cases, FAULT, timeout=540)
    _assert_fault_seen(tmp_path, grid, results, data)


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


SGD_SLOW = [("sft_full_usp2x2_nofsdp_sgd", dict(sp=USP, **SGD)),  # dp 1: the all-reduce path, no FSDP
            ("sft_full_uly2_dp2_nofsdp_sgd", dict(sp=ULY2, **SGD)),
            ("sft_lora_ring2_dp2_fsdp_sgd", dict(method="lora", sp=RING2, fsdp=True, **SGD))]


@pytest.mark.slow
def test_train_loop_sgd_more_meshes(data, tmp_path):
    """More SGD cases vs the SP=1 reference; the full fine-tuning ones also vs the plain-PyTorch loop."""
    cases = [(name, _case(data, tmp_path / name, **kw)) for name, kw in SGD_SLOW]
    results = run_distributed(_train_cases, WORLD, cases, timeout=540)
    _check(data, tmp_path, SGD_SLOW, results)
    for name, case in cases:
        if case["finetuning"]["method"] == "full":  # the plain loop trains every parameter
            dloss, dparam, _ = _check_vs_plain_loop(tmp_path, name, results[0][name], case)
            assert dloss <= TOL and dparam <= TOL, (name, dloss, dparam)
