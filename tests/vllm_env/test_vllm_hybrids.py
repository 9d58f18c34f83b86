"""Hybrid models with the vLLM rollout engine on CPU (seqpar.hf.vllm_models.CPU_HYBRIDS); needs vLLM (the
environment `make vllm-env` builds).

- Falcon-H1 (Mamba2 beside attention in every layer, muP multipliers), the family vLLM 0.32's CPU engine runs: the
  engine built from the config alone gets the tiny model's weights by name (seqpar.hf.weight_stream), samples, and
  its log-probs equal a plain transformers recompute (log_softmax of the logits, fp32) within 1e-4; then the weights
  move (a stand-in for a training step), are pushed again, and the second sample's log-probs equal the recompute
  under the moved weights within 1e-4 and differ from the old weights' by more than 1e-3 (a push that missed the
  Mamba2 or multiplier weights fails). Slow: the engine's start takes a minute or more on a busy 2-core machine.
- Refused before launch, one line naming the fix: the hybrids it does not run (each with the reason found) and, on
  CPU, MoE experts whose width vLLM's CPU MoE pads (its in-place reload then fails on every push).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from seqpar.errors import SeqParError  # noqa: E402
from seqpar.spawn import run_distributed  # noqa: E402

LP_TOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40]]


def _recompute(model: torch.nn.Module, ids: list[list[int]], lps: list[list[float]]) -> float:
    """Max |engine log-prob - log_softmax(transformers logits)| over the sampled tokens (temperature 1)."""
    worst = 0.0
    with torch.no_grad():
        for p, c, lp in zip(PROMPTS, ids, lps):
            logits = model(torch.tensor([p + c])).logits[0].float()
            ref = torch.log_softmax(logits, -1)[len(p) - 1:len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None])
            worst = max(worst, float((ref[:, 0] - torch.tensor(lp)).abs().max()))
    return worst


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


@pytest.mark.slow
def test_falcon_h1_engine_follows_the_pushed_weights():
    first, second, stale = run_distributed(_two_pushes, 1, "falcon_h1", {"head_dim": 32}, timeout=600)[0]
    assert first < LP_TOL and second < LP_TOL, (first, second)
    assert stale > 1e-3, stale  # the second push reached the engine


@pytest.mark.parametrize("arch,kw,needle", [
    ("qwen3_next", {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}, "requires BF16"),
    ("qwen3_5", {}, "needs torchvision"),
    ("lfm2", {"tie_word_embeddings": True}, "log-probs > 1 apart"),
    ("nemotron_h", {"moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}, "is_act_and_mul"),
    ("mamba", {}, "not tried"),
    ("deepseek_v3", {"moe_intermediate_size": 24}, "not a multiple of 32"),
])
def test_refused_before_launch(arch, kw, needle):
    from seqpar.hf.models import tiny_config
    from seqpar.hf.vllm_models import check_vllm_model

    with pytest.raises(SeqParError) as e:
        check_vllm_model(tiny_config(arch, 4, 2, head_dim=32, **kw), on_cuda=False)
    msg = str(e.value)
    assert needle in msg and "engine: transformers" in msg and "\n" not in msg, msg
