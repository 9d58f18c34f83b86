"""Length-aware SP (`sequence_parallel: {size: dynamic, max_local_tokens: 32}`) through `seqpar train`, 4 gloo ranks,
against the fixed run at the size the longest row needs (size 4) over the same rows, and against an independent
single-process reference (the unsharded HF model, textbook token-mean cross-entropy of each step's rows,
torch.optim.SGD).

One spawned 4-rank world trains every case of the module (a fixed and a dynamic run each). Tolerances (fp32):
per-step loss within 1e-5 and gradient norm within 1e-5 (relative above 1) of the fixed run; final parameters
within 1e-5 of the fixed run's and of the reference's (SGD lr 0.5: a gradient-scale error moves them by far more).
The SFT mix (tests/dynamic_cases.py) uses degrees 1, 2 and 4 in one step; every case uses at least two degrees.
"""

from __future__ import annotations

import pytest
import torch
from dynamic_cases import (
    DYNAMIC,
    FIXED,
    compare,
    dpo_case,
    grpo_case,
    sft_case,
    train_cases,
    write_dpo,
    write_grpo,
    write_sft,
)

from seqpar.spawn import run_distributed

TOL = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamic_train")
    sft, dpo, grpo = write_sft(d / "sft.jsonl"), write_dpo(d / "dpo.jsonl"), write_grpo(d / "grpo.jsonl")
    cases = {
        "sft": (sft_case(sft, d / "sft_fixed", FIXED), sft_case(sft, d / "sft_dyn", DYNAMIC)),
        "sft_fsdp": (sft_case(sft, d / "fsdp_fixed", FIXED, fsdp=True), sft_case(sft, d / "fsdp_dyn", DYNAMIC,
                                                                                 fsdp=True)),
        "dpo": (dpo_case(dpo, d / "dpo_fixed", FIXED), dpo_case(dpo, d / "dpo_dyn", {**DYNAMIC,
                                                                                      "max_local_tokens": 64})),
        "grpo": (grpo_case(grpo, d / "grpo_fixed", FIXED), grpo_case(grpo, d / "grpo_dyn", {**DYNAMIC,
                                                                                            "max_local_tokens": 12})),
        "grpo_fsdp": (grpo_case(grpo, d / "grpo_fsdp_fixed", FIXED, fsdp=True),
                      grpo_case(grpo, d / "grpo_fsdp_dyn", {**DYNAMIC, "max_local_tokens": 12}, fsdp=True)),
        "lora_fsdp": (sft_case(sft, d / "lora_fsdp_fixed", FIXED, fsdp=True, lora=True),
                      sft_case(sft, d / "lora_fsdp_dyn", DYNAMIC, fsdp=True, lora=True)),
    }
    flat = [(f"{name}_{kind}", c) for name, pair in cases.items() for kind, c in zip(("fixed", "dyn"), pair)]
    # the dynamic SFT run again with every loss share scaled by 4 (a test-only fault): the reference must see it
    cases["fault"] = (None, sft_case(sft, d / "fault_dyn", DYNAMIC))
    flat.append(("fault_dyn", cases["fault"][1], {"SEQPAR_FAULT_GRAD_SCALE": "4"}))
    return cases, run_distributed(train_cases, 4, flat, timeout=560)


def _final(case: dict) -> dict[str, torch.Tensor]:
    from pathlib import Path
    return torch.load(Path(case["output_dir"]) / "final_state.pt")


def _dparam(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("name", ["sft", "sft_fsdp", "dpo", "grpo", "grpo_fsdp", "lora_fsdp"])
def test_dynamic_equals_fixed(world, name):
    cases, results = world
    fixed, dyn = results[0][f"{name}_fixed"], results[0][f"{name}_dyn"]
    for r in results[1:]:  # every rank logs the same (world-reduced) numbers
        assert [x["loss"] for x in r[f"{name}_dyn"]] == [x["loss"] for x in dyn]
    dloss, dgn = compare(fixed, dyn, TOL)
    dparam = _dparam(_final(cases[name][0]), _final(cases[name][1]))
    used = {int(d) for row in dyn for d in row["sp_degrees"]}
    print(f"{name}: max |dloss| {dloss:.2e}, max |dgrad_norm| {dgn:.2e}, max |dparam| {dparam:.2e}, degrees {used}")
    assert dparam <= TOL, dparam
    assert len(used) >= 2, used
    assert all(row["micro_steps"] >= 1 and row["predicted_rank_s_max"] > 0 and row["rank_s_max"] > 0 for row in dyn)
    per = cases[name][1]["micro_batch_size"] * cases[name][1]["grad_accum"]  # rows (GRPO: completion rows)
    assert all(sum(row["sp_degrees"].values()) == per for row in dyn), [row["sp_degrees"] for row in dyn]


def test_sft_uses_three_degrees_in_one_step(world):
    _, results = world
    assert results[0]["sft_dyn"][0]["sp_degrees"] == {"1": 2, "2": 1, "4": 1}, results[0]["sft_dyn"][0]


def _plain_sgd(case: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Independent reference: the unsharded HF model, sum of CE over every supervised token of the step's rows /
    their count, torch.optim.SGD; rows in file order, grad_accum x micro_batch_size per step (dp 1 at size 4)."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(case)
    examples, _ = prepare_examples(cfg)
    per = cfg.grad_accum * cfg.micro_batch_size
    torch.manual_seed(cfg.seed)
    model = load_model(cfg).train()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr)
    losses = []
    for step in range(cfg.max_steps):
        ce, count = torch.zeros(()), 0
        for ex in examples[step * per:(step + 1) * per]:
            logits = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(ex["labels"][1:])
            ce = ce + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            count += int((labels != -100).sum())
        loss = ce / count
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("name", ["sft", "sft_fsdp"])
def test_dynamic_equals_independent_reference(world, name):
    cases, results = world
    ref_losses, ref_params = _plain_sgd(cases[name][1])
    dyn = results[0][f"{name}_dyn"]
    assert len(ref_losses) == len(dyn) == 3
    dloss = max(abs(a - b["loss"]) for a, b in zip(ref_losses, dyn))
    got = _final(cases[name][1])
    dparam = max(float((got[k] - v).abs().max()) for k, v in ref_params.items())
    print(f"{name} vs plain SGD: max |dloss| {dloss:.2e}, max |dparam| {dparam:.2e}")
    assert dloss <= TOL and dparam <= TOL, (dloss, dparam)


def test_reference_sees_a_gradient_scale_fault(world):
    """The dynamic run with its gradients scaled by 4 (SEQPAR_FAULT_GRAD_SCALE, test-only): the reference comparison
    above fails by far (so it can fail)."""
    cases, _ = world
    ref_losses, ref_params = _plain_sgd(cases["fault"][1])
    got = _final(cases["fault"][1])
    dparam = max(float((got[k] - v).abs().max()) for k, v in ref_params.items())
    assert dparam > 100 * TOL, dparam
