"""`seqpar train` with an eval set, num_epochs, and a DPO row whose prompt alone exceeds max_length.

One spawned 4-rank gloo world (sp=2 x dp=2) runs both cases through `seqpar.train.run.train`:
- SFT + FSDP2, num_epochs=1 over 10 rows (-> ceil(1 x 5 / 2) = 3 steps), eval every 2 steps on 5 rows
  (not divisible by dp=2: one dp rank runs a filler forward to keep the collectives matched). The
  last eval_loss must equal a single-process token-mean cross-entropy of the final weights (plain HF
  forward of the full rows, computed here) within 1e-5 (fp32).
- DPO with one pair whose prompt alone exceeds max_length among good pairs: it is skipped and
  counted, training runs, and the DPO eval (7 pairs over dp=2, with the reference model) must equal the
  pair-mean sigmoid DPO loss (beta 0.1) of the final weights against the initial ones (the reference),
  computed here in one process with the plain HF model on every pair (tests/test_hf_equivalence.py's
  formula), within 1e-5.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from seqpar.spawn import run_distributed

WORLD = 4
TOL = 1e-5
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MODEL = {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}}


def _phrase(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cases(d):
    rng = random.Random(0)
    sft = [{"instruction": _phrase(rng, 1, 5), "output": _phrase(rng, 2, 8)} for _ in range(10)]
    ev = [{"messages": [{"role": "user", "content": _phrase(rng, 1, 4)},
                        {"role": "assistant", "content": _phrase(rng, 1, 6)}]} for _ in range(5)]
    dpo = [{"prompt": _phrase(rng, 1, 4), "chosen": _phrase(rng, 1, 5), "rejected": _phrase(rng, 1, 5)}
           for _ in range(7)]
    dpo.insert(3, {"prompt": "omega " * 40, "chosen": "yes", "rejected": "no"})  # 240+ bytes > max_length
    common = {"model": MODEL, "sequence_parallel": {"size": 2, "ring_degree": 2}, "progress": False, "seed": 0,
              "optimizer": {"lr": 1e-2}, "micro_batch_size": 2}
    return [
        ("sft_eval", {**common, "dataset": {"path": _write(d / "sft.jsonl", sft), "max_length": 96},
                      "eval_dataset": {"path": _write(d / "eval.jsonl", ev), "format": "chat"},
                      "eval_every": 2, "num_epochs": 1, "fsdp": True, "schedule": {"warmup_ratio": 0.9},
                      "checkpoint": {"save_final": True}, "output_dir": str(d / "sft_eval")}),
        ("dpo_long_prompt", {**common, "stage": "dpo", "dataset": {"path": _write(d / "dpo.jsonl", dpo),
                                                                  "max_length": 96},
                             "eval_dataset": str(d / "dpo.jsonl"),  # DPO eval (pair-mean), after the last step
                             "max_steps": 2, "checkpoint": {"save_final": True},
                             "output_dir": str(d / "dpo_long_prompt")}),
    ]


def _train_all(cases):
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    out = {}
    for name, c in cases:
        r = train(config_from_dict(c))
        out[name] = {"losses": r.losses, "eval": r.eval_losses}
    return out


def _reference_eval_loss(case) -> tuple[float, int]:
    """Token-mean CE of the final weights over the eval rows: one process, plain HF forward, no SP."""
    from seqpar.hf import tiny_model
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_tokenizer, tiny_kwargs

    cfg = config_from_dict(case)
    model = tiny_model("llama", **tiny_kwargs(cfg))
    model.load_state_dict(torch.load(f"{case['output_dir']}/final_state.pt"))
    model.eval()
    examples, _ = prepare_examples(cfg, load_tokenizer(cfg), cfg.eval_dataset)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex["input_ids"]])
            labels = torch.tensor(ex["labels"][1:])
            logits = model(input_ids=ids).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
            count += int((labels != -100).sum())
    return float(total / count), count


def _reference_dpo_eval_loss(case) -> tuple[float, int]:
    """Pair-mean DPO loss (the config's: sigmoid, beta 0.1) of the final weights against the initial ones (seqpar
    train's DPO reference: a frozen copy of the policy at the start) over every kept eval pair: one process, plain
    HF forward."""
    from test_hf_equivalence import _ref_dpo

    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_model, load_tokenizer

    cfg = config_from_dict(case)
    assert cfg.dpo.loss_type == "sigmoid" and cfg.dpo.beta == 0.1
    initial = load_model(cfg).eval()  # the weights the run started from (a tiny model seeded by cfg.seed)
    final = load_model(cfg).eval()
    final.load_state_dict(torch.load(f"{case['output_dir']}/final_state.pt"))
    examples, _ = prepare_examples(cfg, load_tokenizer(cfg), cfg.eval_dataset)
    rows = [{k: torch.tensor(ex[k]) for k in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")}
            for ex in examples]
    with torch.no_grad():
        loss = _ref_dpo(final, initial, [rows], cfg.dpo.loss_type, cfg.dpo.beta, cfg.dpo.gamma)
    moved = max(float((a - b).abs().max()) for a, b in zip(final.parameters(), initial.parameters()))
    assert moved > 1e-4, moved  # two steps changed the policy: the reference differs from it
    return float(loss), len(rows)


def test_eval_epochs_and_long_dpo_prompt(tmp_path, capfd):
    cases = _cases(tmp_path)
    results = run_distributed(_train_all, WORLD, cases, timeout=900)
    res = results[0]
    for r in results[1:]:
        assert r == res  # every rank reports the same (all-reduced) numbers

    # num_epochs=1: 10 rows over dp=2 = 5 rows per slot, 2 per step -> 3 steps; evals after steps 2 and 3.
    sft = res["sft_eval"]
    assert len(sft["losses"]) == 3 and [s for s, _ in sft["eval"]] == [2, 3]
    want, n_tokens = _reference_eval_loss(cases[0][1])
    got = sft["eval"][-1][1]
    assert abs(got - want) <= TOL, f"eval_loss {got} vs single-process {want}: {abs(got - want):.3e} > {TOL}"
    with capfd.disabled():
        print(f"eval_loss SP=2 x dp=2 vs single process: |d| = {abs(got - want):.2e} over {n_tokens} tokens")
    out = tmp_path / "sft_eval"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 3] and evals[-1]["eval_items"] == n_tokens
    assert evals[-1]["eval_loss"] == got and (out / "loss.png").is_file()
    lrs = [r["lr"] for r in rows if "lr" in r]
    # warmup_ratio 0.9 of 3 steps = 3 warmup steps; the row's lr is the next step's: 2/3, 3/3, then 1
    assert lrs == [pytest.approx(2e-2 / 3), pytest.approx(1e-2), pytest.approx(1e-2)]

    dpo = res["dpo_long_prompt"]
    assert len(dpo["losses"]) == 2 and all(math.isfinite(x) for x in dpo["losses"])
    assert [s for s, _ in dpo["eval"]] == [2]
    want, n_pairs = _reference_dpo_eval_loss(cases[1][1])
    got = dpo["eval"][0][1]
    assert n_pairs == 7 and abs(got - want) <= TOL, f"DPO eval_loss {got} vs single-process {want} over {n_pairs} pairs"
    with capfd.disabled():
        print(f"DPO eval_loss SP=2 x dp=2 vs single process: |d| = {abs(got - want):.2e} over {n_pairs} pairs")
    printed = capfd.readouterr().out
    assert "dataset: 1 of 8 rows dropped (the DPO prompt alone reaches max_length=96)" in printed
    assert "eval_dataset: 1 of 8 rows dropped (the DPO prompt alone reaches max_length=96)" in printed
