"""`grpo.num_iterations: 2` through `seqpar.train.run.train` vs an independent single-process reference, and
importance sampling (TRL's four vLLM correction modes) in seqpar.loss.grpo_loss under SP 2 vs plain math.

num_iterations reference: plain PyTorch on the unsharded HF model. A rollout at steps 0 and 2 (the same prompts
and seeds as the trainer: the data order and sampler are tests/test_grpo_train.py's), its old log-probs
log_softmax(logits / T) of the sampled tokens computed by hand without gradient right after it; every step the
"grpo" loss mean over rows of the per-row mean of -min(r A, clamp(r, 1 - eps, 1 + eps) A) + beta k3 with
r = exp(logp - old), then SGD. Tolerance: losses and parameters within 1e-5 (fp32). The runs: SP 2 (Ulysses; with
importance_correction: sequence_mask, whose weights are 1 within 1e-4 with the transformers engine), length-aware SP
(size: dynamic under FSDP2, one run of 2 ranks, rows at degrees 1 and 2) and SP 1. A reference that takes old =
the current log-probs (ratio 1 on step 2 as on step 1) differs from the trainer by far more, so the test sees the ratio.
An SP 1 run stopped at its step-2 checkpoint and resumed to step 4 matches the same reference (the data stream
advances once per rollout).

Importance-sampling reference, each of TRL's four modes: loss_t = -min(r A, clamp(r) A) x w + beta k3, w from the
ratio exp(old - sampler) per token or exp(sum over the full row) per sequence, truncated to or masked outside the
bounds, summed per row by hand over the full rows (a padding row, a NaN sampler log-prob, a row on one SP rank
only), the sampler's log-probs perturbed so some ratios fall outside the bounds and some not; compared with
grpo_loss over the SP shards (threaded runner, SP 1 and 2): loss and gradients within 1e-9 (fp64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_grpo_train import PROMPTS, _cfg_dict, _init_params, _sample, _train_world

from seqpar.spawn import run_distributed

TOL = 1e-5
N_ITER = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("grpo_iter")
    with open(d / "prompts.jsonl", "w") as f:
        for r in PROMPTS:
            f.write(json.dumps(r) + "\n")
    return d / "prompts.jsonl"


def _case(data: Path, out: Path, sp: dict) -> dict:
    cfg = {**_cfg_dict(data, out, sp), "max_steps": 4}
    cfg["grpo"] = {**cfg["grpo"], "num_iterations": N_ITER, "max_completion_length": 8}
    cfg["dataset"] = {**cfg["dataset"], "max_length": 32}
    return cfg


def _rollout(cfg, model, stream, step: int) -> list[tuple]:
    """(prompt ids, completion ids, advantage, old log-probs) of one rollout (dp 1)."""
    g = cfg.grpo
    picked = [PROMPTS[i] for i in stream.take(cfg.micro_batch_size * cfg.grad_accum // g.num_generations)]
    model.eval()
    prompts = [list(p["prompt"].encode()) for p in picked]
    comps = _sample(cfg, model, prompts, step, 0, 1)
    rows = []
    for j, (p, ids) in enumerate(zip(picked, prompts)):
        mine = comps[j * g.num_generations:(j + 1) * g.num_generations]
        text = [bytes(t for t in c if t < 256).decode("utf-8", errors="replace") for c in mine]
        r = torch.tensor([len(c) / 100 + 0.5 * float(p["answer"] in t) for c, t in zip(mine, text)],
                         dtype=torch.float64)
        adv = (r - r.mean()) / (r.std() + 1e-4)
        rows += [(ids, c, float(a)) for c, a in zip(mine, adv)]
    model.train()
    with torch.no_grad():  # the old policy's log-probs: once, right after the rollout
        return [(ids, c, a, _logps(model, ids, c, g.temperature)) for ids, c, a in rows]


def _logps(model, ids: list[int], c: list[int], temperature: float) -> torch.Tensor:
    full = torch.tensor([ids + c])
    lp = torch.log_softmax(model(input_ids=full).logits[0, len(ids) - 1:-1] / temperature, -1)
    return lp.gather(-1, torch.tensor(c)[:, None])[:, 0]


def _reference(cfg_dict: dict, old_is_current: bool = False) -> tuple[list[float], dict, float]:
    """(loss per step, parameters after the last, max |ratio - 1| over the steps)."""
    import copy

    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.streams import DataStream
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(cfg_dict)
    g = cfg.grpo
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    ref = copy.deepcopy(model).eval()
    stream = DataStream(len(PROMPTS), 1, 0, shuffle=True, seed=cfg.seed)
    losses, moved, rows = [], 0.0, []
    for step in range(cfg.max_steps):
        if step % g.num_iterations == 0:
            rows = _rollout(cfg, model, stream, step)
        total = 0.0
        for ids, c, a, old in rows:
            lp = _logps(model, ids, c, g.temperature)
            with torch.no_grad():
                rlp = _logps(ref, ids, c, g.temperature)
            r = torch.exp(lp - (lp.detach() if old_is_current else old))
            moved = max(moved, float((r.detach() - 1).abs().max()))
            pol = -torch.min(r * a, torch.clamp(r, 1 - g.epsilon, 1 + g.epsilon) * a)
            total = total + (pol + g.beta * (torch.exp(rlp - lp) - (rlp - lp) - 1)).mean()
        loss = total / len(rows)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= cfg.optimizer.lr * p.grad
        losses.append(float(loss.detach()))
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}, moved


def _train_cases(cases: list[dict]) -> list[dict]:
    return [_train_world(c) for c in cases]


def _gaps(got: dict, ref_losses: list[float], ref_params: dict) -> tuple[float, float]:
    state = torch.load(got["state"])
    assert len(got["losses"]) == len(ref_losses)
    loss_gap = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
    return loss_gap, max(float((state[k].float() - v).abs().max()) for k, v in ref_params.items())


def test_num_iterations_2_sp2_dynamic_sp1_match_reference(data, tmp_path):
    """Four steps, two rollouts (steps 1 and 3 sample; 2 and 4 reuse them with the PPO ratio active)."""
    sp2 = _case(data, tmp_path / "sp2", {"size": 2, "ulysses_degree": 2})
    # engine transformers: the sampler is the policy, ratios ~1 (inside the bounds)
    sp2["grpo"].update(importance_correction="sequence_mask", importance_min=0.5)
    dyn = _case(data, tmp_path / "dyn", {"size": "dynamic", "max_local_tokens": 16})
    dyn["fsdp"] = True  # FSDP2: idle ranks' lockstep forwards, the kept slots' old log-probs from sharded weights
    got = run_distributed(_train_cases, 2, [sp2, dyn], timeout=600)[0]
    one = _train_world(_case(data, tmp_path / "sp1", {"size": 1}))
    # stopped after the first rollout's two steps (a checkpoint at a multiple of num_iterations), then resumed
    res = {**_case(data, tmp_path / "res", {"size": 1}), "checkpoint": {"every": 2, "save_final": True}}
    first = _train_world({**res, "max_steps": 2})
    again = _train_world(res)
    resumed = {"losses": first["losses"] + again["losses"], "state": again["state"]}
    ref_losses, ref_params, moved = _reference(sp2)
    assert moved > 1e-2, moved  # step 2's ratio is off 1 (the policy moved since the rollout)
    assert len(again["losses"]) == 2
    for name, run in (("sp2", got[0]), ("dynamic fsdp", got[1]), ("sp1", one), ("sp1 resumed at 2", resumed)):
        loss_gap, param_gap = _gaps(run, ref_losses, ref_params)
        print(f"num_iterations 2, {name} vs reference: max |loss diff| {loss_gap:.2e}, |param diff| {param_gap:.2e}")
        assert loss_gap <= TOL and param_gap <= TOL, (name, loss_gap, param_gap)
    stale = _reference(sp2, old_is_current=True)  # ratio 1 on every step: what a missing old log-prob gives
    assert _gaps(got[0], stale[0], stale[1])[1] > 100 * TOL
    assert max(float((ref_params[k] - v).abs().max()) for k, v in _init_params(sp2).items()) > 1e-3
    rows = [json.loads(ln) for ln in (tmp_path / "sp2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["grpo_iteration"] for r in rows] == [1, 2, 1, 2]
    assert rows[1]["reward"] == rows[0]["reward"] and rows[3]["reward"] == rows[2]["reward"]  # the same rollout
    assert rows[0]["clip_ratio/region_mean"] == 0.0 and rows[1]["kl"] > 0
    assert all(abs(r["importance_ratio/mean"] - 1) < 1e-4 and r["importance_ratio/capped"] == 0 for r in rows)
    dyn_rows = [json.loads(ln) for ln in (tmp_path / "dyn" / "metrics.jsonl").read_text().splitlines()]
    assert {d for r in dyn_rows for d in r["sp_degrees"]} == {"1", "2"}  # rows at both degrees


def test_resume_mid_rollout_refused_and_checkpoint_every_checked(data, tmp_path):
    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict
    from seqpar.train.lifecycle.checkpoint import save_checkpoint
    from seqpar.train.lifecycle.resume import find_resume, run_meta

    with pytest.raises(ValueError, match="checkpoint.every=3 must be a multiple of grpo.num_iterations=2"):
        config_from_dict({**_case(data, tmp_path / "x", {"size": 1}), "checkpoint": {"every": 3}})
    cfg = config_from_dict(_case(data, tmp_path / "r", {"size": 1}))
    model = torch.nn.Linear(2, 2)
    for step in (2, 3):
        save_checkpoint(tmp_path / "r", step, model, torch.optim.SGD(model.parameters(), lr=0.1), {"step": step},
                        trainable_only=False, keep_last=1, run_meta=run_meta(cfg, 1))
        if step == 2:
            assert find_resume(cfg)[1] == 2  # a rollout's first step: resumes
    with pytest.raises(SeqParError, match=r"middle of a rollout's grpo.num_iterations=2 steps"):
        find_resume(cfg)
    done = config_from_dict({**_case(data, tmp_path / "r", {"size": 1}), "max_steps": 3})
    assert find_resume(done)[1] == 3  # the run is complete at 3: nothing continues the rollout (export only)


# --------------------------------------------------------------------- importance sampling (loss, SP 2)
def _is_case(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    B, S = 5, 12
    labels = torch.randint(0, 50, (B, S), generator=g)
    labels[0, :3] = -100
    labels[1, 7:] = -100
    labels[2, :5] = -100
    labels[3, :] = -100  # a padding row: no completion token (ratio 1, contributes 0, no NaN)
    labels[4, :9] = -100  # a row whose completion lies on SP rank 1 only
    logps = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    sampling = old + scale * torch.randn(B, S, generator=g, dtype=torch.float64)
    sampling[0, 5] = float("nan")  # a token the sampler could not score: no correction for it
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return labels, logps, old, ref, sampling, adv


# mode -> (sampler perturbation, clip_min, clip_max): some tokens / sequences inside the bounds, some outside
IS_MODES = {"token_truncate": (1.0, None, 1.5), "token_mask": (1.0, 0.4, 2.0),
            "sequence_truncate": (0.4, 0.6, 1.6), "sequence_mask": (0.4, 0.5, 2.0)}


def _is_ratio(labels, old, sampling, mode: str) -> torch.Tensor:
    """Per row, the list of its completion tokens' ratios (plain math over the full row)."""
    out = []
    for b in range(labels.shape[0]):
        m = labels[b] != -100
        d = torch.nan_to_num(old[b][m] - sampling[b][m], nan=0.0)
        out.append(torch.exp(d) if mode.startswith("token") else torch.exp(d.sum()).expand(int(m.sum())))
    return out


def _is_reference(labels, logps, old, ref, sampling, adv, mode, lo, hi, beta, eps):
    lp = logps.clone().requires_grad_(True)
    mask = labels != -100
    total = 0.0
    lo_, hi_ = -float("inf") if lo is None else lo, float("inf") if hi is None else hi
    for b, rat in enumerate(_is_ratio(labels, old, sampling, mode)):
        m = mask[b]
        if not m.any():
            continue  # counts as a sequence, contributes 0
        if mode.endswith("truncate"):
            w = torch.clamp(rat, lo_, hi_)
        else:
            w = torch.where((rat < lo_) | (rat > hi_), torch.zeros_like(rat), rat)
        r = torch.exp(lp[b][m] - old[b][m])
        pol = -torch.min(r * adv[b], torch.clamp(r, 1 - eps, 1 + eps) * adv[b]) * w
        d = ref[b][m] - lp[b][m]
        total = total + (pol + beta * (torch.exp(d) - d - 1)).sum() / m.sum()
    loss = total / labels.shape[0]
    loss.backward()
    return float(loss.detach()), lp.grad


def _is_rank(mode: str, beta: float, eps: float, want_grad: torch.Tensor):
    """This rank's (loss share, max |gradient - the reference's on its shard|, metrics)."""
    import torch.distributed as dist

    import seqpar
    from seqpar import loss as L
    from seqpar.layout import shard

    scale, lo, hi = IS_MODES[mode]
    mesh = seqpar.init_mesh(dist.get_world_size())
    labels, logps, old, ref, sampling, adv = _is_case(0, scale)
    sh = {k: shard(v, mesh, dim=1) for k, v in dict(labels=labels, logps=logps, old=old, ref=ref,
                                                      sampling=sampling).items()}
    lp = sh["logps"].clone().requires_grad_(True)
    den = L.grpo_denominators([{"shift_labels": sh["labels"]}], mesh)
    share, met = L.grpo_loss(lp, adv, sh["labels"], den, old_logps=sh["old"], ref_logps=sh["ref"], beta=beta,
                             epsilon_low=eps, loss_type="grpo", mesh=mesh, sampling_logps=sh["sampling"],
                             importance=L.ImportanceSampling.from_name(mode, lo, hi))
    share.backward()
    assert torch.isfinite(lp.grad).all()
    gap = float((lp.grad - shard(want_grad, mesh, dim=1)).abs().max())
    return float(share.detach()), gap, {k: float(v) for k, v in met.items()}


@pytest.mark.parametrize("mode", list(IS_MODES))
@pytest.mark.parametrize("sp", [1, 2])
def test_importance_sampling_loss_sp_matches_reference(sp, mode):
    from seqpar.threaded import run_threaded

    beta, eps = 0.04, 0.2
    scale, lo, hi = IS_MODES[mode]
    labels, logps, old, ref, sampling, adv = _is_case(0, scale)
    rat = torch.cat(_is_ratio(labels, old, sampling, mode))
    outside = ((rat > hi) if lo is None else (rat < lo) | (rat > hi))
    assert outside.any() and (~outside).any(), rat  # some ratios truncated / masked, some not
    if lo is not None:
        assert (rat < lo).any(), rat  # the lower bound acts too
    want, want_grad = _is_reference(labels, logps, old, ref, sampling, adv, mode, lo, hi, beta, eps)
    res = run_threaded(_is_rank, sp, mode, beta, eps, want_grad)
    got = sum(r[0] for r in res)
    assert abs(got - want) <= 1e-9, (got, want)
    w = torch.clamp(rat, lo, hi) if mode.endswith("truncate") else torch.where(outside, 0 * rat, rat)
    for _, gap, met in res:
        assert gap <= 1e-9, gap
        assert abs(met["importance_ratio/mean"] - float(w.mean())) <= 1e-9
        assert abs(met["importance_ratio/capped"] - float(outside.double().mean())) <= 1e-9
        assert abs(met["sampling/importance_sampling_ratio/min"] - float(w.min())) <= 1e-9
        assert abs(met["sampling/importance_sampling_ratio/max"] - float(w.max())) <= 1e-9
        # TRL's mean: over tokens (token modes), over completions (sequence modes: one w per completion)
        trl_mean = w.mean() if mode.startswith("token") else torch.stack(
            [x[0] for x in torch.split(w, [int(m.sum()) for m in labels != -100]) if len(x)]).mean()
        assert abs(met["sampling/importance_sampling_ratio/mean"] - float(trl_mean)) <= 1e-9
    uncorrected, _ = _is_reference(labels, logps, old, ref, sampling, adv, mode, None, 1e30, beta, eps)
    assert abs(uncorrected - want) > 1e-3  # the bounds changed the loss: the test sees them
    other = {"token_truncate": "sequence_truncate", "sequence_truncate": "token_truncate",
             "token_mask": "sequence_mask", "sequence_mask": "token_mask"}[mode]
    assert abs(_is_reference(labels, logps, old, ref, sampling, adv, other, lo, hi, beta, eps)[0] - want) > 1e-3
