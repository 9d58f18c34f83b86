"""Hybrid models with the vLLM rollout engine on CPU (seqpar.hf.vllm_models.CPU_HYBRIDS); needs vLLM (the
environment `make vllm-env` builds).

- Falcon-H1 (Mamba2 beside attention in every layer, muP multipliers) and LFM2 (short convs, then attention with
  q / k norms; tied), the families vLLM 0.32's CPU engine runs: the engine built from the config alone gets the
  tiny model's weights by name (seqpar.hf.weight_stream), samples, and its log-probs equal a plain transformers
  recompute (log_softmax of the logits, fp32) within 1e-4; then the weights move (a stand-in for a training step),
  are pushed again, and the second sample's log-probs equal the recompute under the moved weights within 1e-4 and
  differ from the old weights' by more than 1e-3 (a push that missed the Mamba2, conv or multiplier weights fails).
  Slow: each engine's start takes up to a minute on a busy 2-core machine. The same on a tied tiny Llama (not
  slow): the tied lm_head must follow the pushes.
- `seqpar train` GRPO with engine vllm on tied LFM2: SP 2 == SP 1 (slow).
- Refused before launch, one line naming the fix: the hybrids it does not run (each with the reason found) and, on
  CPU, MoE experts whose width vLLM's CPU MoE pads (its in-place reload then fails on every push).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from engine_check import LP_TOL, PROMPTS  # noqa: E402
from engine_check import recompute_gap as _recompute

from seqpar.errors import SeqParError  # noqa: E402
from seqpar.spawn import run_distributed  # noqa: E402


def _two_pushes(arch: str, kw: dict) -> tuple[float, float, float]:
    import copy

    from seqpar.hf.models import tiny_model
    from seqpar.hf.vllm_engine import VLLMEngine
    from seqpar.hf.vllm_models import check_vllm_model
    from seqpar.hf.weight_stream import named_full_weights

    model = tiny_model(arch, 4, 2, **kw).float().eval()
    check_vllm_model(model.config, on_cuda=False)
    eng = VLLMEngine(model.config, max_model_len=64, max_num_seqs=2, dtype=torch.float32,
                     gpu_memory_utilization=0.3, enforce_eager=True)
    sample = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, eos_token_id=-1 % model.config.vocab_size)
    try:
        eng.push(named_full_weights(model))
        ids, lps = eng.generate(PROMPTS, [3, 4], **sample)
        first = _recompute(model, ids, lps)
        old = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        eng.push(named_full_weights(model))
        ids, lps = eng.generate(PROMPTS, [5, 6], **sample)
        return first, _recompute(model, ids, lps), _recompute(old, ids, lps)
    finally:
        eng.close()


def _check_two_pushes(arch: str, kw: dict) -> None:
    first, second, stale = run_distributed(_two_pushes, 1, arch, kw, timeout=600)[0]
    assert first < LP_TOL and second < LP_TOL, (first, second)
    assert stale > 1e-3, stale  # the second push reached the engine


def test_tied_lm_head_follows_the_pushed_weights():
    """Tied embeddings: vLLM's CPU logits use a packed copy of lm_head's weight that its reload does not refresh
    for a tied head (the engine repacks it after each push); without that, every log-prob here is > 1 off."""
    _check_two_pushes("llama", {"head_dim": 32, "tie_word_embeddings": True})


@pytest.mark.slow
def test_falcon_h1_engine_follows_the_pushed_weights():
    _check_two_pushes("falcon_h1", {"head_dim": 32})


@pytest.mark.slow
def test_lfm2_engine_follows_the_pushed_weights():
    """LFM2 (short convs with bias, then attention with q / k norms; tied): needs the repacked tied lm_head and
    vLLM's torch rotary path (its CPU rotary kernel rotates LFM2's 3-D q / k wrongly, even at position 0)."""
    _check_two_pushes("lfm2", {"head_dim": 32, "tie_word_embeddings": True})


@pytest.mark.parametrize("arch,kw,needle", [
    ("qwen3_next", {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}, "requires BF16"),
    ("qwen3_5", {}, "needs torchvision"),
    ("lfm2", {"tie_word_embeddings": False}, "always ties lm_head"),
    ("nemotron_h", {"moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}, "is_act_and_mul"),
    ("zamba2", {"tie_word_embeddings": False}, "always ties lm_head"),
    ("zamba2", {"tie_word_embeddings": True}, "not exact here"),
    ("mamba", {}, "selective-scan"),
    ("granitemoehybrid", {"mamba_d_head": 16}, "KeyError"),
    ("kimi_linear", {"moe_intermediate_size": 32}, "_lib_fn_wrapper"),
    ("jamba", {}, "selective-scan"),
    ("recurrent_gemma", {}, "has no architecture"),
    ("deepseek_v3", {"moe_intermediate_size": 24}, "not a multiple of 32"),
])
def test_refused_before_launch(arch, kw, needle):
    from seqpar.hf.models import tiny_config
    from seqpar.hf.vllm_models import check_vllm_model

    with pytest.raises(SeqParError) as e:
        check_vllm_model(tiny_config(arch, 4, 2, head_dim=32, **kw), on_cuda=False)
    msg = str(e.value)
    assert needle in msg and "engine: transformers" in msg and "\n" not in msg, msg


@pytest.mark.slow
def test_lfm2_grpo_sp2_equals_sp1(tmp_path):
    """`seqpar train`, GRPO with engine vllm on tied LFM2 (every step changes the tied embeddings the engine's
    lm_head must follow): SP 2 on 2 ranks and SP 1 on 1 rank draw the same completions, with per-step losses
    within 1e-5 and each step's trainer-vs-engine log-prob mismatch below 1e-4."""
    import json
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from test_grpo_vllm import PROMPTS as ROWS
    from test_grpo_vllm import _cfg, _rows, _train

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    runs = {}
    for sp in (2, 1):
        cfg = _cfg(data, tmp_path / f"sp{sp}", sp, beta=0.0)
        cfg["model"] = {"name": "tiny:lfm2", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
                                                         "tie_word_embeddings": True}}
        cfg["checkpoint"] = {"every": 0}
        runs[sp] = run_distributed(_train, sp, cfg, timeout=600)[0]
    a, b = _rows(tmp_path / "sp2" / "rollouts.jsonl"), _rows(tmp_path / "sp1" / "rollouts.jsonl")
    assert len(a) == len(b) == 8
    assert [(r["prompt_ids"], r["completion_ids"]) for r in a] == [(r["prompt_ids"], r["completion_ids"]) for r in b]
    assert any(abs(r["advantage"]) > 0.1 for r in a)  # the steps learn, so step 2 samples moved weights
    assert len(runs[2]) == len(runs[1]) == 2
    assert max(abs(p - q) for p, q in zip(runs[2], runs[1])) < 1e-5, (runs[2], runs[1])
    for sp in (2, 1):
        assert all(m["rollout_logprob_diff_max"] < LP_TOL for m in _rows(tmp_path / f"sp{sp}" / "metrics.jsonl"))
