"""TRL's own logged metrics under SP equal what stock TRL logs on one process for the same run.

Reference: the STOCK trl.SFTTrainer / trl.DPOTrainer, one process, run in the test process; SP run: seqpar.trl's
classes in a spawned gloo world, otherwise the same script (tests/test_trl.py's rows, tiny model, SmolLM2
tokenizer, sequential data order, per-device batch 2 x grad accumulation 2, SGD, 3 steps logged every step). After
training, evaluate() on a held-out set. Compared on every training log row and the eval row: SFT "entropy",
"mean_token_accuracy" (over the shifted supervised targets), "num_tokens" (the running input-token total, exactly);
DPO also "logits/chosen|rejected", "rewards/chosen|rejected|accuracies|margins", "logps/chosen|rejected" (the DPO
reference model is a second random model, so the rewards are not 0 at the first step; the model's output rows of the
data's words are scaled up so that some targets are argmax hits). Tolerance: 1e-5 relative to max(|stock|, 1), for
the rewards to max(|stock|, 1, beta * |logps|) (a reward is beta times a difference of two log-prob sums of magnitude
~100, which SP and stock agree on to ~1e-7 relative: measured reward errors ~1e-5 absolute, logps ~1e-5 absolute).
A per-token instead of per-micro-batch average, a row counted once per SP rank, or a length-normalised IPO reward
is off by far more; num_tokens must be exact.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_trl import WORDS, _config, _dataset, _tok

from seqpar.spawn import run_distributed

TOL = 1e-5
BETA = 0.5  # test_trl._config's DPO beta
SFT_KEYS = ("entropy", "mean_token_accuracy", "num_tokens")
DPO_KEYS = ("entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy", "rewards/chosen",
            "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def _model(arch: str, tok, seed: int = 0):
    """The tiny random model, its output rows of the data's words scaled up: argmax then lands on a data word, so
    some targets are hits (with 49k random rows it never does, and mean_token_accuracy would be 0 = 0)."""
    from seqpar.hf import tiny_model

    heads, kv = (4, 2) if arch == "llama" else (3, 1)
    model = tiny_model(arch, heads, kv, vocab_size=len(tok), seed=seed)
    words = sorted(set(tok(" " + " ".join(WORDS) + " " + " ".join(WORDS))["input_ids"]))
    with torch.no_grad():
        model.get_output_embeddings().weight[words] *= 6.0
    return model


def _rows(logs: list[dict], keys: tuple[str, ...]) -> dict[str, list[dict]]:
    """The TRL metrics of each training log row and of the eval row (eval_ keys)."""
    train = [{k: h[k] for k in keys if k in h} for h in logs if "loss" in h]
    ev = [{k: h[f"eval_{k}"] for k in keys if f"eval_{k}" in h} for h in logs if "eval_loss" in h]
    return {"train": train, "eval": ev}


def _train(case: dict, out: str, sp: int | None) -> dict[str, list[dict]]:
    """Stock TRL when sp is None, else seqpar.trl with sequence_parallel_size=sp (and fused_loss=case["fused"])."""
    import datasets
    import trl

    import seqpar.trl as strl

    tok = _tok()
    dpo = case["stage"] == "dpo"
    kw = {} if sp is None else {"sequence_parallel_size": sp, "fused_loss": case.get("fused", True)}
    if dpo:
        cls = trl.DPOTrainer if sp is None else strl.SequenceParallelDPOTrainer
        kw["ref_model"] = _model(case["arch"], tok, seed=1)
    else:
        cls = trl.SFTTrainer if sp is None else strl.SequenceParallelSFTTrainer
    per_rank = case.get("dp", 1) if sp is None else 1  # dp x sp: a stock batch holds all dp ranks' rows
    args = _config(case, out, 2 * per_rank)
    args.per_device_eval_batch_size = 4 * per_rank  # an eval step: the same rows (10 = 8 + 2) on both sides
    data = _dataset(case["data"])  # 12 rows: dp=2 splits them evenly (no sampler wrap-around on either side)
    held_out = datasets.Dataset.from_list([data[i] for i in range(len(data) - 1, 1, -1)])  # 10 rows, other order
    if case.get("compute_metrics"):  # evaluate() takes the full-logits path; TRL's eval metrics must still come
        kw["compute_metrics"] = lambda p: {"rows": float(len(p.label_ids))}
    trainer = cls(model=_model(case["arch"], tok), args=args, train_dataset=data, eval_dataset=held_out,
                  processing_class=tok, **kw)
    trainer.train()
    trainer.evaluate()
    return _rows(trainer.state.log_history, DPO_KEYS if dpo else SFT_KEYS)


def _sp_world(cases: list[dict], out: str) -> list[dict]:
    world = torch.distributed.get_world_size()
    return [_train(case, f"{out}/{i}", world // case.get("dp", 1)) for i, case in enumerate(cases)]


def _scale(key: str, value: float, row: dict) -> float:
    """What an error is relative to: max(|value|, 1); for a reward beta * (logps - ref_logps), a difference of
    log-prob sums of magnitude ~100, also beta * |logps| (fp32 sums agree to ~1e-7 of that, not of the reward)."""
    if key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        return max(abs(value), 1.0, BETA * max(abs(row["logps/chosen"]), abs(row["logps/rejected"])))
    return max(abs(value), 1.0)


def _compare(name: str, got: dict, ref: dict) -> tuple[float, str]:
    """Max error relative to max(|stock|, 1) over every logged value; num_tokens exactly; the same keys and rows."""
    worst = (0.0, "")
    for part in ("train", "eval"):
        assert len(got[part]) == len(ref[part]) == (3 if part == "train" else 1), (name, part, got, ref)
        for step, (g, r) in enumerate(zip(got[part], ref[part])):
            assert set(g) == set(r) and r, (name, part, step, sorted(g), sorted(r))
            for k, v in r.items():
                if k == "num_tokens":
                    assert g[k] == v and v > 0, (name, part, step, g[k], v)
                    continue
                err = abs(g[k] - v) / _scale(k, v, r)
                assert math.isfinite(g[k]) and err <= TOL, (name, part, step, k, g[k], v)
                if err > worst[0]:
                    worst = (err, f"{part} {step} {k}")
    assert any(r.get("mean_token_accuracy", 0) > 0 for r in ref["train"]), ref  # not a vacuous 0 = 0
    return worst


def _check_all(results: list[list[dict]], cases: list[dict], refs: list[dict]) -> None:
    for rank_res in results[1:]:
        assert rank_res == results[0]  # every rank logs the same values
    assert len(results[0]) == len(cases) == len(refs)
    for case, got, ref in zip(cases, results[0], refs):
        err, where = _compare(case["name"], got, ref)
        print(f"{case['name']}: max error {err:.1e} ({where}); stock rows {ref}")


def _run(cases: list[dict], world: int, tmp_path) -> None:
    refs = [_train(c, str(tmp_path / f"ref{i}"), None) for i, c in enumerate(cases)]
    _check_all(run_distributed(_sp_world, world, cases, str(tmp_path / "sp"), timeout=480), cases, refs)


FAST = [
    {"name": "sft completion_only_loss, fused loss", "stage": "sft", "arch": "qwen2", "data": "prompt_completion",
     "completion_only_loss": True},
    {"name": "sft completion_only_loss, full logits", "stage": "sft", "arch": "qwen2", "data": "prompt_completion",
     "completion_only_loss": True, "fused": False},
    {"name": "dpo sigmoid, max_length cut", "stage": "dpo", "arch": "qwen2", "data": "pairs", "max_length": 24},
    {"name": "sft with compute_metrics", "stage": "sft", "arch": "qwen2", "data": "prompt_completion",
     "completion_only_loss": True, "compute_metrics": True},
]
SLOW = [
    {"name": "sft dp=2 x sp=2 messages", "stage": "sft", "arch": "llama", "data": "messages", "dp": 2},
    # 5 packed rows: dp=1 (at dp=2 the SP sampler wraps around to an even split, the stock run does not)
    {"name": "sft sp=4 packing bfd", "stage": "sft", "arch": "llama", "data": "text", "packing": True,
     "max_length": 40},
    {"name": "sft sp=4 padding_free, full logits", "stage": "sft", "arch": "llama", "data": "messages",
     "padding_free": True, "max_length": None, "fused": False},
    {"name": "dpo ipo dp=2 x sp=2 (rewards of the summed log-probs)", "stage": "dpo", "arch": "llama",
     "data": "pairs", "loss": "ipo", "dp": 2},
    {"name": "dpo sigmoid sp=4, full logits", "stage": "dpo", "arch": "llama", "data": "pairs", "fused": False},
]


# The fast twin of both slow tests here: SLOW's dp 2 x sp 2 rows (SFT on messages, DPO IPO, every training row and
# the eval row vs stock TRL) run in tests/test_trl_dp2.py's 4-rank world, with the TRL SFT / GRPO dp 2 twins (an SP 2
# world of its own for these cases cost ~1 min of the fast suite's budget).
@pytest.mark.slow
def test_trl_metrics_sp2_match_stock_trl(tmp_path):
    _run(FAST, 2, tmp_path)


@pytest.mark.slow
def test_trl_metrics_sp4_match_stock_trl(tmp_path):
    _run(SLOW, 4, tmp_path)


def test_chunk_metrics_leave_the_loss_alone_and_match_trl_kernel(monkeypatch):
    """The per-token metrics from the fused chunks: the NLL and every gradient bit-identical with and without them,
    computed once per chunk (not again in the checkpoint's backward recompute), equal to the full-logits helper and
    to TRL's own chunked kernel (entropy, is_top1 with its first-maximum tie rule, mean logit)."""
    from trl.kernels import ChunkedLogProbFunction

    from seqpar import loss as L

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g))
    hidden = torch.randn(2, 9, 16, generator=g)
    with torch.no_grad():
        labels = torch.where(torch.rand(2, 9, generator=g) < 0.5, head(hidden).argmax(-1),
                             torch.randint(0, 50, (2, 9), generator=g))
    labels[0, :3] = -100
    labels[1, -2:] = -100

    def run(metrics):
        h = hidden.clone().requires_grad_(True)
        head.zero_grad()
        nll, _ = L.chunked_token_stats(h, labels, head, 4, metrics=metrics)
        nll.sum().backward()
        return nll.detach(), h.grad, head.weight.grad.clone()

    from seqpar.loss import nll  # the chunked head's module (seqpar.loss only re-exports)

    calls = []
    real = nll._metric_stats
    monkeypatch.setattr(nll, "_metric_stats", lambda *a: calls.append(1) or real(*a))
    m: dict = {}
    with_m, without = run(m), run(None)
    assert all(torch.equal(a, b) for a, b in zip(with_m, without))
    assert len(calls) == 4  # 14 supervised targets in chunks of 4: once each, none in the backward recompute
    mask = labels != -100
    full = L.token_metric_stats(head(hidden).detach(), labels, chunk_tokens=3)
    lp, ent, _, mean, top1 = ChunkedLogProbFunction.apply(hidden[mask], head.weight.detach(), None, labels[mask], 1.0,
                                                          16, None, 1.0, ("log_probs", "entropy", "mean_logits",
                                                                          "is_top1"))
    trl_stats = {"entropy": ent, "is_top1": top1.float(), "mean_logits": mean}
    for k in L.TOKEN_METRICS:
        assert torch.allclose(m[k], full[k], atol=1e-6, rtol=1e-6), k
        assert torch.allclose(m[k][mask], trl_stats[k].detach(), atol=1e-5, rtol=1e-6), k
        assert not m[k][~mask].any() and not m[k].requires_grad, k
    assert 0 < float(m["is_top1"][mask].mean()) < 1
    z = torch.tensor([[[1.0, 3.0, 3.0, 0.0]]])  # a tie: the first maximum is the argmax
    assert [float(L.token_metric_stats(z, torch.tensor([[t]]))["is_top1"]) for t in (1, 2)] == [1.0, 0.0]
