"""`stage: grpo` through `seqpar.train.run.train` vs an independent single-process reference.

The reference is plain PyTorch on the unsharded HF model: the same prompts (the data sampler's
order), completions drawn by seqpar.hf.generation.generate_for_group on the UNPATCHED model as one
SP=1 process per dp rank (sampling itself is tested in tests/test_grpo_runtime.py),
rewards and advantages written out here ((r - mean) / (std + 1e-4) per prompt), and the "grpo"
loss by hand: mean over ALL sequences of the step (every dp rank) of the per-sequence mean of
-A * exp(logp - logp.detach()) + beta * k3(ref, logp), logp = log_softmax(logits / T); SGD steps.
Tolerance: parameters and loss within 1e-5 absolute (fp32).

fast: dp2 x sp2 (ulysses 2), two steps (the second samples from the updated policy, KL > 0),
metrics logged. slow: ring 2 (zigzag, world 2), one step, vs the same reference, and the SP=2 run
vs the trainer's own SP=1 run (same seed: identical completions); Qwen3.5, Qwen3-Next (Gated DeltaNet),
Nemotron-H (Mamba2; Ulysses and ring) and Qwen2.5-VL and Qwen3-VL (text prompts) at SP=2, two steps, vs the same
reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seqpar.spawn import run_distributed

TOL = 1e-5
PROMPTS = [{"prompt": "alpha beta", "answer": "a"}, {"prompt": "gamma", "answer": "m"},
           {"prompt": "delta epsilon zeta", "answer": "z"}, {"prompt": "eta", "answer": "t"},
           {"prompt": "theta iota", "answer": "i"}, {"prompt": "kappa lambda mu", "answer": "u"}]


def _cfg_dict(data: Path, out: Path, sp: dict, model: dict | None = None) -> dict:
    # seed 9: step 1's rewards differ within a prompt group with dp 2 and dp 1 (the near-uniform tiny model
    # rarely samples EOS or the answer byte: with many seeds every reward is equal and step 1 updates nothing).
    return {
        "model": model or {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2}},
        "dataset": {"path": str(data), "max_length": 48}, "stage": "grpo", "sequence_parallel": sp,
        "micro_batch_size": 2, "grad_accum": 2, "max_steps": 1, "seed": 9, "output_dir": str(out),
        "optimizer": {"name": "sgd", "lr": 0.5}, "checkpoint": {"save_final": True}, "progress": False,
        "export": {"final": False}, "memory": {"measure": False},
        "grpo": {"reward_funcs": ["seqpar:length", "seqpar:contains"], "reward_weights": [1.0, 0.5],
                 "num_generations": 2, "max_prompt_length": 24, "max_completion_length": 12,
                 "temperature": 0.7, "beta": 0.04},
    }


def _train_world(cfg_dict: dict) -> dict:
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    res = train(config_from_dict(cfg_dict))
    return {"losses": res.losses, "state": res.final_state_path}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("grpo_train")
    with open(d / "prompts.jsonl", "w") as f:
        for r in PROMPTS:
            f.write(json.dumps(r) + "\n")
    return d / "prompts.jsonl"


def _reference(cfg_dict: dict, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Independent reference of max_steps GRPO steps with `dp` dp ranks (see the module docstring):
    (loss per step, parameters after the last)."""
    import copy

    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.streams import DataStream
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    ref = copy.deepcopy(model).eval()  # the frozen initial policy (KL reference)
    # Data order only (not under test): the trainer's stream of row indices per dp rank.
    streams = [DataStream(len(PROMPTS), dp, d, shuffle=True, seed=cfg.seed) for d in range(dp)]
    losses = []
    for step in range(cfg.max_steps):
        losses.append(_reference_step(cfg, model, ref, streams, step))
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}


def _sample(cfg, model, prompts: list[list[int]], step: int, d: int, dp: int) -> list[list[int]]:
    """Sampling (not under test here; tests/test_grpo_runtime.py tests it): seqpar's sampler on the UNPATCHED
    model as one SP=1 process playing dp rank d of dp, so the completions are the ones the trainer draws (seeded
    by each prompt's position in the step's global batch)."""
    from types import SimpleNamespace

    from seqpar.hf.generation import generate_for_group

    g = cfg.grpo
    mesh = SimpleNamespace(sp_size=1, sp_rank=0, dp_rank=d, dp_size=1, sp_group=None, comm_device=torch.device("cpu"))
    return generate_for_group(model, mesh, prompts, num_generations=g.num_generations,
                              max_new_tokens=g.max_completion_length, temperature=g.temperature, top_p=1.0,
                              seed=cfg.seed, step=step, eos_token_id=257, pad_token_id=258,
                              prompt_index=[d + dp * j for j in range(len(prompts))])


def _reference_step(cfg, model, ref, streams, step: int) -> float:
    g = cfg.grpo
    eos = 257
    per_dp = cfg.micro_batch_size * cfg.grad_accum // g.num_generations
    rows = []  # (prompt ids, completion ids, advantage)
    for d, stream in enumerate(streams):
        picked = [PROMPTS[i] for i in stream.take(per_dp)]
        model.eval()
        prompts = [list(p["prompt"].encode()) for p in picked]
        comps = _sample(cfg, model, prompts, step, d, len(streams))
        for j, (p, ids) in enumerate(zip(picked, prompts)):
            mine = comps[j * g.num_generations:(j + 1) * g.num_generations]
            assert all(c[-1] == eos or len(c) == g.max_completion_length for c in mine)
            text = [bytes(t for t in c if t < 256).decode("utf-8", errors="replace") for c in mine]
            r = torch.tensor([len(c) / 100 + 0.5 * float(p["answer"] in t) for c, t in zip(mine, text)],
                             dtype=torch.float64)
            adv = (r - r.mean()) / (r.std() + 1e-4)
            rows += [(ids, c, float(a)) for c, a in zip(mine, adv)]
    model.train()
    total = 0.0
    for ids, c, a in rows:
        full = torch.tensor([ids + c])
        lp = torch.log_softmax(model(input_ids=full).logits[0, len(ids) - 1:-1] / g.temperature, -1)
        lp = lp.gather(-1, torch.tensor(c)[:, None])[:, 0]
        with torch.no_grad():
            rlp = torch.log_softmax(ref(input_ids=full).logits[0, len(ids) - 1:-1] / g.temperature, -1)
            rlp = rlp.gather(-1, torch.tensor(c)[:, None])[:, 0]
        k3 = torch.exp(rlp - lp) - (rlp - lp) - 1
        per_tok = -a * torch.exp(lp - lp.detach()) + g.beta * k3
        total = total + per_tok.mean()
    loss = total / len(rows)
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:  # a VL model's vision tower gets none from text prompts (SGD skips it too)
                p -= cfg.optimizer.lr * p.grad
    return float(loss.detach())


def _compare(losses, state_path, ref_losses, ref_params, cfg_dict):
    state = torch.load(state_path)
    assert len(losses) == len(ref_losses)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    worst = max(float((state[k].float() - v).abs().max()) for k, v in ref_params.items())
    moved = max(float((state[k].float() - v).abs().max()) for k, v in _init_params(cfg_dict).items())
    assert worst <= TOL, worst
    assert moved > 1e-3  # the step changed the parameters: the comparison is not vacuous
    return worst


def _init_params(cfg_dict: dict):
    from seqpar.train.config import config_from_dict
    from seqpar.train.model.load import load_model

    cfg = config_from_dict(cfg_dict)
    torch.manual_seed(cfg.seed)
    return {k: v.detach() for k, v in load_model(cfg).named_parameters()}


def test_grpo_dp2_sp2_matches_reference_and_logs_metrics(data, tmp_path):
    """Two steps: step 2 samples from the updated policy and has a non-zero KL to the frozen copy."""
    cfg = {**_cfg_dict(data, tmp_path / "run", {"size": 2, "ulysses_degree": 2}), "max_steps": 2}
    cfg["grpo"] = {**cfg["grpo"], "log_rollouts": True}
    res = run_distributed(_train_world, 4, cfg, timeout=600)
    ref_losses, ref_params = _reference(cfg, dp=2)
    worst = _compare(res[0]["losses"], res[0]["state"], ref_losses, ref_params, cfg)
    gap = max(abs(a - b) for a, b in zip(res[0]["losses"], ref_losses))
    print(f"dp2 x sp2, 2 steps vs reference: losses {res[0]['losses']} vs {ref_losses}, max |loss diff| = "
          f"{gap:.2e}, max |param diff| = {worst:.2e}")
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    row = rows[0]
    for key in ("loss", "reward", "reward_std", "rewards/seqpar:length", "rewards/seqpar:contains", "kl",
                "clip_ratio/region_mean", "completion_length", "completion_length_min", "completion_length_max",
                "completions_empty", "completions_clipped", "grad_norm"):
        assert key in row, key
    assert 1 <= row["completion_length_min"] <= row["completion_length"] <= row["completion_length_max"] <= 12
    assert abs(row["kl"]) <= 1e-6  # step 1: the reference is the policy
    assert rows[1]["kl"] > 1e-6  # step 2: the policy moved away from the frozen copy
    # generate()'s log-probs of the sampled tokens vs the trainer's exact SP ones: the same up to rounding
    assert all(0 <= r["rollout_logprob_diff_mean"] <= r["rollout_logprob_diff_max"] < 1e-4 for r in rows)
    rollouts = [json.loads(ln) for ln in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rollouts] == [1] * 8 + [2] * 8  # both dp groups' 4 rows per step
    assert all(len(r["logprobs"]) == len(r["completion_ids"]) >= 1 and max(r["logprobs"]) <= 0 for r in rollouts)
    assert abs(sum(r["reward"] for r in rollouts[:8]) / 8 - row["reward"]) < 1e-9


@pytest.mark.slow
def test_grpo_ring2_and_sp1_same_step(data, tmp_path):
    cfg2 = _cfg_dict(data, tmp_path / "sp2", {"size": 2, "ring_degree": 2})
    res = run_distributed(_train_world, 2, cfg2, timeout=600)
    ref_losses, ref_params = _reference(cfg2, dp=1)
    worst = _compare(res[0]["losses"], res[0]["state"], ref_losses, ref_params, cfg2)
    print(f"ring 2 vs reference: max |param diff| = {worst:.2e}")
    one = _train_world(_cfg_dict(data, tmp_path / "sp1", {"size": 1}))
    assert abs(one["losses"][0] - res[0]["losses"][0]) <= TOL
    s1, s2 = torch.load(one["state"]), torch.load(res[0]["state"])
    diff = max(float((s1[k] - s2[k]).abs().max()) for k in s1)
    gap = abs(one["losses"][0] - res[0]["losses"][0])
    print(f"SP=2 vs SP=1: |loss diff| = {gap:.2e}, max |param diff| = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("arch,fsdp,mode", [("qwen3_5", False, "ulysses"), ("qwen3_next", False, "ulysses"),
                                            ("qwen2_5_vl", False, "ulysses"), ("qwen3_vl", False, "ulysses"),
                                            ("qwen3_5", True, "ulysses"), ("qwen3_5", False, "ring"),
                                            ("nemotron_h", False, "ring"), ("qwen3_next", True, "ring")])
def test_grpo_hybrid_and_vl_sp2_match_reference(data, tmp_path, arch, fsdp, mode):
    """Qwen3.5 / Qwen3-Next (Gated DeltaNet) and Nemotron-H (Mamba2) under Ulysses and under a ring of 2 (state
    passing), and Qwen2.5-VL / Qwen3-VL (text prompts): two GRPO
    steps at SP=2 (every SP rank generating with SP paused, KL on) vs the independent reference on the
    unpatched model; before the fix generation stopped at step 1 (linear-attention forward without a plan,
    a VL model's plan hook left in place). VL seed 24: the random tiny policy samples its image / video
    placeholder ids (259, 260; about 0.7% of draws), which the SP forward refuses without images (docs/grpo.md),
    in none of the completions, and step 1's rewards differ within a group (the policy moves)."""
    model = {"name": f"tiny:{arch}", "kwargs": {"num_heads": 4, "num_kv_heads": 2}}
    seed = 24 if arch.endswith("_vl") else 9
    degrees = {"size": 2, "ulysses_degree": 2} if mode == "ulysses" else {"size": 2, "ring_degree": 2}
    cfg = {**_cfg_dict(data, tmp_path / "run", degrees, model), "max_steps": 2, "seed": seed,
           "fsdp": fsdp}  # FSDP2: every rank generates its share with synced forwards (all-gathers), SP paused
    cfg["grpo"] = {**cfg["grpo"], "max_completion_length": 6}
    res = run_distributed(_train_world, 2, cfg, timeout=600)
    ref_losses, ref_params = _reference(cfg, dp=1)
    worst = _compare(res[0]["losses"], res[0]["state"], ref_losses, ref_params, cfg)
    print(f"{arch} SP=2 fsdp={fsdp}, 2 steps vs reference: losses {res[0]['losses']} vs {ref_losses}, "
          f"max |param diff| = {worst:.2e}")


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen2_5_vl"])
def test_generation_pause_lifts_linear_forwards_and_vl_hooks(arch):
    """Fast guard: inside sequence_parallel_paused a Qwen3.5 (Gated DeltaNet forwards replaced by SP) and a
    Qwen2.5-VL model (plan hook on its language model, input guard on its outer model) generate exactly as
    the unpatched model; afterwards every replaced forward and hook is back (the same objects)."""
    import copy

    import seqpar
    from seqpar.errors import SeqParError
    from seqpar.hf import apply_sequence_parallel, tiny_model
    from seqpar.hf.generation import sequence_parallel_paused
    from seqpar.hf.linear_attention import find_linear_attention

    model = tiny_model(arch, num_heads=4, num_kv_heads=2, seed=0).eval()
    plain = copy.deepcopy(model)
    apply_sequence_parallel(model, seqpar.init_mesh(1))
    forwards = {id(m): m.__dict__["forward"] for m in find_linear_attention(model)}
    hooks = [(d, dict(d)) for h in model._seqpar_state.handles for d in (h.hooks_dict_ref(),) if d is not None]
    x = torch.tensor([[5, 6, 7, 8, 9]])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=6, pad_token_id=0)
    with sequence_parallel_paused(model):
        got = model.generate(input_ids=x, **kw)
    assert got.tolist() == plain.generate(input_ids=x, **kw).tolist()
    assert {id(m): m.__dict__.get("forward") for m in find_linear_attention(model)} == forwards
    assert all(dict(d) == saved and len(d) > 0 for d, saved in hooks)
    if arch.endswith("_vl"):  # the SP input guard is active again
        with pytest.raises(SeqParError, match="position_ids"):
            model(input_ids=x)
    else:  # the SP forward is back: a full-sequence forward with global positions runs through it
        out = model(input_ids=x, position_ids=torch.arange(5)[None]).logits
        assert torch.allclose(out, plain(input_ids=x).logits, atol=1e-5)


def test_hybrid_degrees_checked_before_launch(data, tmp_path):
    """A Gated DeltaNet model: ring and USP pass the launch checks (state passing); a Ulysses degree its linear k
    heads cannot split is refused there (`seqpar check`, before any process starts), not by
    apply_sequence_parallel after the process group exists."""
    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict, validate_for_launch
    from seqpar.train.model.load import model_heads, model_recurrent_heads

    model = {"name": "tiny:qwen3_5", "kwargs": {"num_heads": 4, "num_kv_heads": 2}}
    cfg = config_from_dict(_cfg_dict(data, tmp_path / "run", {"size": 2, "ring_degree": 2}, model))
    nh, nkv = model_heads(cfg)
    rec = model_recurrent_heads(cfg)
    assert rec is not None and rec.heads == 4
    assert validate_for_launch(cfg, 2, num_heads=nh, num_kv_heads=nkv, recurrent=rec) == (1, 2)
    ok = config_from_dict(_cfg_dict(data, tmp_path / "run", {"size": 2}, model))
    assert validate_for_launch(ok, 2, num_heads=nh, num_kv_heads=nkv, recurrent=rec) == (2, 1)
    model8 = {"name": "tiny:qwen3_5", "kwargs": {"num_heads": 8, "num_kv_heads": 8}}
    bad = config_from_dict(_cfg_dict(data, tmp_path / "run", {"size": 8, "ulysses_degree": 8}, model8))
    with pytest.raises(SeqParError, match=r"which ulysses_degree=8 cannot split: use a ulysses_degree among"):
        validate_for_launch(bad, 8, num_heads=8, num_kv_heads=8, recurrent=model_recurrent_heads(bad))
