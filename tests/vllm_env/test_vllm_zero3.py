"""The weight push from a DeepSpeed ZeRO-3 policy into colocated vLLM engines (what the HF / TRL drop-ins run
under DeepSpeed do), 2 ranks, fp32; needs vLLM and DeepSpeed (both in the environment `make vllm-env` builds).

Each rank wraps the same tiny Llama with LoRA adapters (B random, so the merge matters) in a ZeRO-3 engine (every
parameter partitioned), starts its vLLM engine from the config alone (random weights), pushes
seqpar.hf.weight_stream.named_full_weights(engine) and samples. The engine's log-probs equal a plain transformers
recompute with the unsharded, merged model within 1e-4, and differ from the base weights' (adapters off) by more
than 1e-3: the merged adapters, gathered from partitions, are what the engine samples. During the push each rank
holds at most one parameter in full (plus a LoRA weight's own adapters), counted at every tensor handed over.
Slow: a ZeRO-3 world plus two engine starts.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

from engine_check import LP_TOL, PROMPTS  # noqa: E402
from engine_check import recompute_gap as _recompute

from seqpar.spawn import run_distributed  # noqa: E402


def _counted(named, module: torch.nn.Module, seen: list[int]):
    """named, recording at each tensor how many elements this rank holds in full (ZeRO-3 status)."""
    for item in named:
        seen.append(sum(p.ds_numel for p in module.parameters() if p.ds_status.name != "NOT_AVAILABLE"))
        yield item


def _rank() -> dict:
    import deepspeed
    from peft import LoraConfig, get_peft_model

    from seqpar.hf.models import tiny_model
    from seqpar.hf.vllm_engine import VLLMEngine
    from seqpar.hf.weight_stream import named_full_weights

    base = tiny_model("llama", 4, 2, head_dim=32).float().eval()
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    merged = copy.deepcopy(pm).merge_and_unload().eval()
    unadapted = copy.deepcopy(pm)  # for the recompute with the adapters off
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=pm, optimizer=torch.optim.SGD(pm.parameters(), lr=0.1), config=ds)
    eng = VLLMEngine(merged.config, max_model_len=64, max_num_seqs=2, dtype=torch.float32,
                     gpu_memory_utilization=0.3, enforce_eager=True, rank=torch.distributed.get_rank())
    seen: list[int] = []
    try:
        eng.push(_counted(named_full_weights(engine), engine.module, seen))
        ids, lps = eng.generate(PROMPTS, [3, 4], max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0,
                                eos_token_id=-1 % merged.config.vocab_size)
    finally:
        eng.close()
    with unadapted.disable_adapter():
        stale = _recompute(unadapted, ids, lps)
    # one parameter and, were it a LoRA weight (r 4), its A [4, in] and B [out, 4]: the most one push step may hold
    biggest = max(p.numel() + (4 * sum(p.shape) if p.dim() == 2 else 0) for p in merged.parameters())
    return {"diff": _recompute(merged, ids, lps), "stale": stale, "most": max(seen), "bound": biggest,
            "total": sum(p.numel() for p in merged.parameters()), "pushed": len(seen)}


@pytest.mark.slow
def test_zero3_lora_push_into_vllm():
    for r in run_distributed(_rank, 2, timeout=600):
        assert r["diff"] < LP_TOL, r
        assert r["stale"] > 1e-3, r  # without the merged adapters the log-probs are far off
        assert 0 < r["most"] <= r["bound"] < r["total"] / 4, r  # one parameter (and its adapters) at a time
