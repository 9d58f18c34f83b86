"""The attention variants of issue-56 families through whole HF models: sliding windows shorter than the sequence
(gpt-oss with sinks, Gemma 3, Mistral; Qwen2-MoE and PhiMoE, whose layers do not pass the window to the
attention function), MLA (DeepSeek-V3: v head dim != q/k head dim, MoE), Llama 4 text (NoPE
temperature from global positions, chunked attention). Each tiny model (fixed seed, fp32) under ring 2, Ulysses 2
and USP 2 x 2 against the unmodified model on every document alone (seqpar.hf.equivalence.compare): loss, every
real-token logit and every parameter gradient within 1e-5, padded rows (B = 2) and packed rows."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from hf_grid import assert_within, run_grid

from seqpar.threaded import run_threaded

TOL = 1e-5
COMMON = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "attention_dropout": 0.0}


def _configs() -> dict[str, tf.PretrainedConfig]:
    return {
        "gpt_oss": tf.GptOssConfig(**COMMON, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                   num_local_experts=4, num_experts_per_tok=2),
        "gemma3": tf.Gemma3TextConfig(**COMMON, sliding_window=5,
                                      layer_types=["sliding_attention", "full_attention"]),
        "mistral": tf.MistralConfig(**COMMON, sliding_window=7),
        # the window only on the module (Qwen2-MoE) or only in the model's mask (PhiMoE: every layer)
        "qwen2_moe": tf.Qwen2MoeConfig(**COMMON, use_sliding_window=True, sliding_window=6,
                                       layer_types=["sliding_attention", "full_attention"], num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=16,
                                       shared_expert_intermediate_size=16),
        "phimoe": tf.PhimoeConfig(**COMMON, sliding_window=5, num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v3": tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16,
                                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4,
                                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                           n_group=1, topk_group=1, moe_intermediate_size=16),
        "llama4": tf.Llama4TextConfig(**COMMON, no_rope_layers=[1, 0], attention_chunk_size=6, floor_scale=4,
                                      attn_scale=0.5, attn_temperature_tuning=True, num_local_experts=2,
                                      num_experts_per_tok=1, interleave_moe_layer_step=1, intermediate_size_mlp=32),
    }


def _model(cfg):
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    for p in model.parameters():  # sinks and the like start at zero / empty in some inits: give every weight values
        if p.dim() == 1 and torch.all(p == 0):
            torch.nn.init.normal_(p, std=0.5)
    return model


ROWS = [[{"input_ids": list(range(3, 32))}, {"input_ids": [5, 9, 2, 7] * 5 + [11, 12, 13]}]]


def _run(models, modes):
    return run_grid(models, modes, ROWS)


def _check(results):
    assert_within(results, TOL)


@pytest.fixture(scope="module")
def models():
    return {name: _model(cfg) for name, cfg in _configs().items()}


def test_variants_ring2_ulysses2(models):
    _check(run_threaded(_run, 2, models, [(1, 2), (2, 1)], timeout=400))


def test_variants_usp_2x2(models):
    _check(run_threaded(_run, 4, {k: models[k] for k in ("gpt_oss", "llama4", "deepseek_v3")}, [(2, 2)],
                        timeout=400))


def test_windows_and_chunks_are_shorter_than_the_rows():
    """The tiny configs really exercise the variants: windows and chunks shorter than the rows."""
    cfgs = _configs()
    assert all(cfgs[n].sliding_window < 23 for n in ("gpt_oss", "gemma3", "mistral", "qwen2_moe", "phimoe"))
    assert cfgs["llama4"].attention_chunk_size < 23 and "chunked_attention" in cfgs["llama4"].layer_types
    assert cfgs["deepseek_v3"].v_head_dim != cfgs["deepseek_v3"].qk_rope_head_dim + cfgs["deepseek_v3"].qk_nope_head_dim
