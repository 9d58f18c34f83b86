"""`stage: grpo` with `grpo.rollout.engine: vllm` (seqpar.hf.vllm_engine): needs vLLM, so these run in the
environment `make vllm-env` builds (`make test` runs them there after the main suite; elsewhere they skip).

- SP 2 on 2 ranks (Ulysses) and SP 1 on 1 rank, same seed, fp32, beta > 0 (the frozen reference model), 2 steps:
  the same completions (rollouts.jsonl) and per-step losses within 1e-5; each step's trainer-vs-engine log-prob
  mismatch (rollout_logprob_diff_max) below 1e-4; the KL to the reference 0 at step 1 and > 1e-4 at step 2, equal
  within 1e-5 under both layouts (so the reference term is in the compared losses). SP 2 runs twice: one engine per
  SP group (tensor_parallel: sp, the default: vLLM tensor parallel over the SP group) and (slow) one engine per rank
  (tensor_parallel: 1).
- The engine's logged log-probs of step 2's completions equal an independent transformers recompute (plain model,
  log_softmax(logits / T)) from the weights after step 1 (the checkpoint) within 1e-4, and differ from the initial
  weights' (step 0) by more than 1e-3: a missed weight push fails the test.
- (slow) num_iterations 2 with importance_correction tis and rollout.sleep on (a no-op on CPU: vLLM's CPU platform
  has no sleep mode, checked): SP 2 == SP 1 (one rollout, both steps' losses within 1e-5).
- dp 2 x SP 1 draws the SP 1 run's completions; then rank 1's engine fails at step 2 and both ranks stop with the
  same one-line SeqParError.
- Refusals before launch: head_dim the CPU attention refuses, mode: server, tensor_parallel neither 1 nor the SP
  size, heads vLLM cannot split over the SP group, a short max_model_len.
- Slow: dp 2 x SP 2 with tensor_parallel: sp (vLLM's TP groups are the SP groups; the SP 1 run's completions); a
  failed weight push on one rank of a TP group stops both ranks before sampling; LoRA under FSDP2 with beta > 0 (the
  reference: adapters off), SP 2 (one engine per SP group) vs SP 1 (the merged adapters are what the engine samples,
  the KL checked as above); a resume after step 1 rebuilds the engine and repeats the uninterrupted run's step 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from seqpar.errors import SeqParError  # noqa: E402
from seqpar.spawn import DistributedFailure, run_distributed  # noqa: E402

TOL = 1e-5
LP_TOL = 1e-4
HERE = Path(__file__).parent
PROMPTS = [{"prompt": "alpha beta", "answer": "a"}, {"prompt": "gamma", "answer": "m"},
           {"prompt": "delta epsilon zeta", "answer": "z"}, {"prompt": "eta", "answer": "t"}]


def _cfg(data: Path, out: Path, sp: int, **grpo) -> dict:
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32}},
        "dataset": {"path": str(data), "max_length": 48}, "stage": "grpo", "sequence_parallel": {"size": sp},
        "micro_batch_size": 2, "grad_accum": 2, "max_steps": 2, "seed": 9, "output_dir": str(out),
        "optimizer": {"name": "sgd", "lr": 0.5}, "checkpoint": {"every": 1}, "progress": False,
        "export": {"final": False}, "memory": {"measure": False},
        "grpo": {"reward_funcs": ["vllm_rewards:low_ids"], "num_generations": 2, "max_prompt_length": 24,
                 "max_completion_length": 12, "temperature": 0.7, "beta": 0.04, "log_rollouts": True,
                 "rollout": {"engine": "vllm"}, **grpo},
    }


def _train(cfg_dict: dict, fail_at: int | None = None, fail_in: str = "generate") -> list[float]:
    from seqpar.hf import vllm_engine
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # vllm_rewards
    if fail_at is not None and int(os.environ["RANK"]) == 1:  # this rank's engine dies at rollout `fail_at`
        real, calls = getattr(vllm_engine.VLLMEngine, fail_in), []

        def dying(self, *a, **k):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("EngineDeadError: the engine core died")
            return real(self, *a, **k)

        setattr(vllm_engine.VLLMEngine, fail_in, dying)
    start = vllm_engine.VLLMEngine.__init__

    def recorded(self, *a, **k):  # the TP group each rank's engine formed: output_dir/engine_rank<R>.json
        start(self, *a, **k)
        from vllm.distributed import parallel_state as ps

        Path(cfg_dict["output_dir"], f"engine_rank{os.environ['RANK']}.json").write_text(
            json.dumps(ps.get_tp_group().ranks))

    vllm_engine.VLLMEngine.__init__ = recorded
    return train(config_from_dict(cfg_dict)).losses


def _tp_groups(out: Path, world: int) -> list[list[int]]:
    return [json.loads((out / f"engine_rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("grpo_vllm")
    with open(d / "prompts.jsonl", "w") as f:
        for r in PROMPTS:
            f.write(json.dumps(r) + "\n")
    return d / "prompts.jsonl"


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("runs")
    # what a killed vLLM TP run leaves in /dev/shm: vLLM names its CPU all-reduce segments after "env://" alone, so
    # they would block this run's engine (errno 17) if seqpar did not name each run's own
    stale = [Path(f"/dev/shm/-tp:0-[0-1]-cpushm_{r}") for r in range(2)]
    made = [p for p in stale if Path("/dev/shm").is_dir() and not p.exists()]
    for p in made:
        p.write_bytes(b"")
    try:
        sp2 = run_distributed(_train, 2, _cfg(data, out / "sp2", 2), timeout=420)  # tensor_parallel: sp (default)
    finally:
        for p in made:
            p.unlink(missing_ok=True)
    sp1 = run_distributed(_train, 1, _cfg(data, out / "sp1", 1), timeout=420)
    return {"out": out, "data": data, "sp2": sp2[0], "sp1": sp1[0]}  # "sp2tp1": run by its (slow) test


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("sp2", ["sp2", pytest.param("sp2tp1", marks=pytest.mark.slow)])
def test_sp2_equals_sp1(runs, sp2):
    """SP 2 with one engine per SP group (tensor_parallel: sp, vLLM TP 2: each rank holds half of every layer) and
    (slow) with one engine per rank (tensor_parallel: 1, each rank samples half of the prompts; the fast set runs
    one engine per rank in its dp 2 run) vs SP 1 (one engine)."""
    if sp2 not in runs:
        cfg = _cfg(runs["data"], runs["out"] / sp2, 2, rollout={"engine": "vllm", "tensor_parallel": 1})
        runs[sp2] = run_distributed(_train, 2, cfg, timeout=420)[0]
    a, b = _rows(runs["out"] / sp2 / "rollouts.jsonl"), _rows(runs["out"] / "sp1" / "rollouts.jsonl")
    assert len(a) == len(b) == 8  # 2 steps x 2 prompts x 2 generations
    assert [(r["step"], r["prompt_ids"], r["completion_ids"]) for r in a] == \
        [(r["step"], r["prompt_ids"], r["completion_ids"]) for r in b]
    for x, y in zip(a, b):
        assert abs(x["reward"] - y["reward"]) < TOL and abs(x["advantage"] - y["advantage"]) < TOL
        assert max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])) < LP_TOL
    # one vLLM engine over the SP group (each rank holds half of it), or one per rank
    assert _tp_groups(runs["out"] / sp2, 2) == ([[0, 1], [0, 1]] if sp2 == "sp2" else [[0], [1]])
    assert len(runs[sp2]) == len(runs["sp1"]) == 2
    assert max(abs(p - q) for p, q in zip(runs[sp2], runs["sp1"])) < TOL, (runs[sp2], runs["sp1"])
    assert any(abs(r["advantage"]) > 0.1 for r in a)  # the steps learn (else step 2 would not test the push)
    for run in ("sp1", sp2):
        for m in _rows(runs["out"] / run / "metrics.jsonl"):
            assert m["rollout_logprob_diff_max"] < LP_TOL and m["rollout_logprob_diff_mean"] <= m[
                "rollout_logprob_diff_max"]
    _check_kl(runs["out"] / "sp2", runs["out"] / "sp1")


def _check_kl(sp2: Path, sp1: Path) -> None:
    """beta > 0: the KL to the reference model is 0 at step 1 (policy = reference) and positive at step 2 (the
    reference term is in the loss, not skipped), the same under both layouts."""
    a, b = _rows(sp2 / "metrics.jsonl"), _rows(sp1 / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    assert abs(a[0]["kl"]) < TOL and abs(b[0]["kl"]) < TOL, (a[0]["kl"], b[0]["kl"])
    assert a[1]["kl"] > 1e-4 and abs(a[1]["kl"] - b[1]["kl"]) < TOL, (a[1]["kl"], b[1]["kl"])


def _recompute(cfg: dict, state: dict | None, rows: list[dict], temperature: float) -> float:
    """Max |engine log-prob - plain transformers log_softmax(logits / T)| over `rows`' tokens, the model built as
    seqpar builds it (seeded) and, given `state`, loaded with those weights."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.model.load import load_model

    c = config_from_dict(cfg)
    torch.manual_seed(c.seed)
    model = load_model(c).float().eval()
    if state is not None:
        model.load_state_dict(state)
    worst = 0.0
    with torch.no_grad():
        for r in rows:
            p, c = r["prompt_ids"], r["completion_ids"]
            logits = model(torch.tensor([p + c])).logits[0].float() / temperature
            ref = torch.log_softmax(logits, -1)[len(p) - 1:len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None])
            worst = max(worst, float((ref[:, 0] - torch.tensor(r["logprobs"])).abs().max()))
    return worst


def test_logprobs_follow_the_weights(runs, data, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = runs["out"] / "sp2"
    dcp_to_torch_save(out / "checkpoint-1", tmp_path / "ck1.pt")
    after1 = torch.load(tmp_path / "ck1.pt", weights_only=False)["model"]
    step2 = [r for r in _rows(out / "rollouts.jsonl") if r["step"] == 2]
    step1 = [r for r in _rows(out / "rollouts.jsonl") if r["step"] == 1]
    cfg = _cfg(data, out, 2)
    assert _recompute(cfg, after1, step2, 0.7) < LP_TOL
    assert _recompute(cfg, None, step1, 0.7) < LP_TOL  # step 1 sampled from the initial weights
    stale = _recompute(cfg, None, step2, 0.7)
    assert stale > 1e-3, stale  # step 2 under the initial weights differs: a missed push would show


def test_dp2_then_a_dead_engine_stops_every_rank(runs, data, tmp_path):
    """dp 2 x SP 1 (grad_accum 1: the SP 1 run's global batch): step 1 draws the SP 1 run's completions (the seeds
    follow the prompts' positions in the global batch, not the dp rank); at step 2 rank 1's engine dies and both
    ranks stop with the same line (agreed over dp), no hang."""
    cfg = {**_cfg(data, tmp_path / "dead", 1), "grad_accum": 1}
    cfg["checkpoint"] = {"every": 0}
    with pytest.raises(DistributedFailure) as e:
        run_distributed(_train, 2, cfg, fail_at=2, timeout=420)
    msg = str(e.value)
    want = "vLLM rollout failed on rank 1: RuntimeError: EngineDeadError: the engine core died"
    assert msg.count(want) >= 2, msg[-3000:]  # both ranks raise it, at the same step (no hang)
    got = _rows(tmp_path / "dead" / "rollouts.jsonl")
    want_rows = [r for r in _rows(runs["out"] / "sp1" / "rollouts.jsonl") if r["step"] == 1]
    assert [r["step"] for r in got] == [1] * 4  # step 2 never finished
    assert [(r["prompt_ids"], r["completion_ids"]) for r in got] == \
        [(r["prompt_ids"], r["completion_ids"]) for r in want_rows]


@pytest.mark.slow  # make test-all; num_iterations / TIS are exact against a reference in tests/test_grpo_iterations.py
def test_num_iterations_2_and_tis_sp2_equals_sp1(data, tmp_path):
    """num_iterations 2 (step 2 reuses step 1's rollout, the ratio against its old log-probs) with truncated
    importance sampling: SP 2 on 2 ranks and SP 1 on 1 rank draw the same completions once and agree on both
    steps' losses within 1e-5; the engine's log-probs equal the trainer's, so each weight is 1 within 1e-4."""
    def cfg(name: str, sp: int) -> dict:
        # tensor_parallel 1: TIS puts the engine's log-probs into the loss, and vLLM TP 2 sums the matmuls in
        # another order (its log-probs move ~1e-6): step 2's loss of ~2.15 then moved 1.1e-5 (5e-6 relative)
        c = _cfg(data, tmp_path / name, sp, num_iterations=2, importance_correction="tis",
                 rollout={"engine": "vllm", "tensor_parallel": 1, "sleep": True})  # sleep on CPU: a no-op
        # lr 0.02: at 0.5 step 2's unclipped ratios of negative advantages make a loss ~4e3 (fp32 rounding 1e-2)
        return {**c, "checkpoint": {"every": 2}, "optimizer": {"name": "sgd", "lr": 0.02}}

    sp2 = run_distributed(_train, 2, cfg("sp2", 2), timeout=420)[0]
    sp1 = run_distributed(_train, 1, cfg("sp1", 1), timeout=420)[0]
    a, b = _rows(tmp_path / "sp2" / "rollouts.jsonl"), _rows(tmp_path / "sp1" / "rollouts.jsonl")
    assert [r["step"] for r in a] == [1] * 4  # one rollout for the two steps
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    assert len(sp2) == 2 and max(abs(p - q) for p, q in zip(sp2, sp1)) < TOL, (sp2, sp1)
    assert any(abs(r["advantage"]) > 0.1 for r in a)
    for run in ("sp1", "sp2"):
        m = _rows(tmp_path / run / "metrics.jsonl")
        assert [r["grpo_iteration"] for r in m] == [1, 2] and m[0]["reward"] == m[1]["reward"]
        for r in m:
            assert abs(r["importance_ratio/mean"] - 1) < LP_TOL and r["importance_ratio/capped"] == 0
            assert r["rollout_logprob_diff_max"] < LP_TOL  # step 2 too: the old log-probs vs the engine's
        assert m[0]["clip_ratio/region_mean"] == 0 < m[1]["clip_ratio/region_mean"]  # step 2's ratio is off 1


def test_cpu_platform_has_no_sleep_mode():
    """Why grpo.rollout.sleep is a no-op on CPU (seqpar.hf.vllm_engine.sleep_mode_available): vLLM's CPU platform
    has no sleep mode, and the engine there is built without it."""
    from vllm.platforms import current_platform

    from seqpar.hf.vllm_engine import sleep_mode_available

    assert current_platform.is_cpu() and not current_platform.is_sleep_mode_available()
    assert not sleep_mode_available()


@pytest.mark.slow
def test_dp2_sp2_tensor_parallel(runs, data, tmp_path):
    """dp 2 x SP 2 on 4 ranks, tensor_parallel: sp (grad_accum 1: the SP 1 run's global batch): vLLM's TP groups are
    the SP groups [0, 1] and [2, 3], and step 1 draws the SP 1 run's completions."""
    cfg = {**_cfg(data, tmp_path / "dp2", 2), "grad_accum": 1, "max_steps": 1}
    run_distributed(_train, 4, cfg, timeout=600)
    assert _tp_groups(tmp_path / "dp2", 4) == [[0, 1], [0, 1], [2, 3], [2, 3]]
    got = _rows(tmp_path / "dp2" / "rollouts.jsonl")
    want = [r for r in _rows(runs["out"] / "sp1" / "rollouts.jsonl") if r["step"] == 1]
    assert [(r["prompt_ids"], r["completion_ids"]) for r in got] == \
        [(r["prompt_ids"], r["completion_ids"]) for r in want]


@pytest.mark.slow
def test_tensor_parallel_failed_push_stops_the_group(data, tmp_path):
    """SP 2, one engine over the group: rank 1's weight push fails at step 2; both ranks stop with its line before
    either samples (sampling is collective over the TP group: a lone rank would wait in it)."""
    cfg = {**_cfg(data, tmp_path / "dead", 2), "checkpoint": {"every": 0}}
    with pytest.raises(DistributedFailure) as e:
        run_distributed(_train, 2, cfg, fail_at=2, fail_in="push", timeout=420)
    msg = str(e.value)
    assert msg.count("vLLM rollout failed on rank 1: RuntimeError: EngineDeadError: the engine core died") >= 2, \
        msg[-3000:]
    assert [r["step"] for r in _rows(tmp_path / "dead" / "rollouts.jsonl")] == [1] * 4  # step 2 never sampled


@pytest.mark.slow
def test_sp2_equals_sp1_lora_fsdp2(data, tmp_path):
    """LoRA under FSDP2: the merged adapters pushed from sharded parameters; SP 2 on 2 ranks vs SP 1 on 1 rank."""
    extra = {"finetuning": {"method": "lora", "r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]},
             "fsdp": True, "optimizer": {"name": "sgd", "lr": 2.0}}
    sp2 = run_distributed(_train, 2, {**_cfg(data, tmp_path / "sp2", 2), **extra}, timeout=420)[0]
    sp1 = run_distributed(_train, 1, {**_cfg(data, tmp_path / "sp1", 1), **extra}, timeout=420)[0]
    a, b = _rows(tmp_path / "sp2" / "rollouts.jsonl"), _rows(tmp_path / "sp1" / "rollouts.jsonl")
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    assert max(abs(p - q) for p, q in zip(sp2, sp1)) < TOL, (sp2, sp1)
    assert any(abs(r["advantage"]) > 0.1 for r in a)
    for run in ("sp1", "sp2"):
        for m in _rows(tmp_path / run / "metrics.jsonl"):
            assert m["rollout_logprob_diff_max"] < LP_TOL  # the engine samples the merged, current policy
    _check_kl(tmp_path / "sp2", tmp_path / "sp1")  # the reference: the base model, adapters off
    # the base weights never move under LoRA: step 2 under them (no adapter delta) is far from what was logged
    stale = _recompute({**_cfg(data, tmp_path / "sp1", 1), **extra}, None, [r for r in a if r["step"] == 2], 0.7)
    assert stale > 1e-3, stale


@pytest.mark.slow
def test_resume_rebuilds_the_engine(runs, data, tmp_path, monkeypatch):
    """A run stopped after step 1's checkpoint and resumed: the new process builds its engine, pushes the restored
    weights, and step 2 equals the uninterrupted SP 1 run's (completions, log-probs, loss)."""
    from seqpar.train.lifecycle.process import FAULT_ENV

    cfg = _cfg(data, tmp_path / "r", 1)
    monkeypatch.setenv(FAULT_ENV, "1")  # the rank exits right after step 1 (and its checkpoint)
    with pytest.raises(DistributedFailure):
        run_distributed(_train, 1, cfg, timeout=420)
    monkeypatch.delenv(FAULT_ENV)
    losses = run_distributed(_train, 1, cfg, timeout=420)[0]
    assert len(losses) == 1 and abs(losses[0] - runs["sp1"][1]) < TOL, (losses, runs["sp1"])
    got, want = _rows(tmp_path / "r" / "rollouts.jsonl"), _rows(runs["out"] / "sp1" / "rollouts.jsonl")
    assert [(r["step"], r["completion_ids"]) for r in got] == [(r["step"], r["completion_ids"]) for r in want]
    assert max(abs(p - q) for x, y in zip(got, want) for p, q in zip(x["logprobs"], y["logprobs"])) < LP_TOL


@pytest.mark.parametrize("change,needle", [
    ({"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8}}},
     "head_dim=8 is not one vLLM's CPU attention runs"),
    ({"grpo.rollout.mode": "server"}, "use mode: colocate"),
    ({"grpo.rollout.tensor_parallel": 3}, "tensor_parallel=3 with sequence_parallel size 2"),
    ({"model": {"name": "tiny:llama", "kwargs": {"num_heads": 3, "num_kv_heads": 1, "head_dim": 32}}},
     "cannot split the model's num_attention_heads=3 over 2 ranks"),
    ({"grpo.rollout.max_model_len": 20}, "grpo.rollout.max_model_len=20"),
])
def test_refusals_before_launch(data, tmp_path, change, needle):
    from seqpar.train.config import config_from_dict
    from seqpar.train.lifecycle.launch import prelaunch_checks

    cfg = _cfg(data, tmp_path / "r", 2)
    for k, v in change.items():
        if k.startswith("grpo.rollout."):
            cfg["grpo"]["rollout"][k.rsplit(".", 1)[1]] = v
        else:
            cfg[k] = v
    with pytest.raises((SeqParError, ValueError)) as e:
        prelaunch_checks(config_from_dict(cfg), 2)
    assert needle in str(e.value)
