"""The causal-LM families of the installed transformers and a tiny config of each, for the family sweep
(seqpar.hf.family_sweep).

The list is computed, not typed: every entry of transformers' causal-LM auto mapping, each either swept or
excluded with the reason (the decoder half of an encoder-decoder, a composite / multimodal model, a model class
another entry already sweeps). The tiny config is derived from the config class's defaults by one rule table
(2 layers, or one of each layer kind the defaults list; hidden 64, 4 q / 2 kv heads of 16, vocab 128, MoE shrunk
to 4 experts top-2, every dropout 0, sliding windows and attention chunks of 16 tokens: shorter than the sweep's
documents, so the variants are exercised); the families that need more have an override below, each saying why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["Family", "families", "tiny_family_config", "WINDOW"]

WINDOW = 16  # sliding windows / attention chunks: shorter than every document of the sweep's batches

# standard name -> tiny value; the config's own name is found through its attribute_map (n_embd, n_head, ...)
_TINY = {
    "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 256,
    "rotary_dim": 8, "n_inner": 64, "dff": 64, "dim_ff": 64, "decoder_ffn_dim": 64, "d_inner": 64,
    "dense_intermediate_size": 64, "output_embedding_size": 64, "ffn_dim": 64, "intermediate_size_mlp": 64,
    "ffn_hidden_size": 64,
    # MoE: 4 experts, top-2, one shared; one dense layer first where the family has them (both kinds run)
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2, "n_shared_experts": 1,
    "num_shared_experts": 1, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "zero_expert_num": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1,
    # MLA (DeepSeek-V2/V3): compressed q / kv, a v head dim unlike the qk one
    "kv_lora_rank": 16, "q_lora_rank": 24, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 12,
    # sparse attention indexers (DeepSeek-V3.2 and kin): keep the top 8 keys per query, fewer than the sequence has
    "index_topk": 8, "index_head_dim": 16, "index_n_heads": 2,
    # Llama 4's attention temperature on NoPE layers grows every floor_scale positions: 8, so it varies here
    "floor_scale": 8,
    # Mamba / Mamba2 mixers: 8 heads of 16 (= 2 x hidden), state 8, SSD chunks of 16
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_d_ssm": 128,
    "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8, "mamba_chunk_size": 16,
    # windows / chunks shorter than the sequence
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "keep_window_size": WINDOW,
    "initializer_range": 0.1,  # wider than HF's 0.02: attention far from uniform, so a wrong mask shows
    "use_cache": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
_COMPOSITE_WORDS = ("text", "vision", "audio", "vq", "encoder", "patcher")  # sub-configs of a composite model
_ZERO_WORDS = ("dropout", "pdrop", "jitter")  # float settings that make train mode random: 0

# Per-family overrides, each with its reason.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # Qwen2-style configs use the window only with use_sliding_window and from layer max_window_layers on
    "qwen2": {"use_sliding_window": True, "max_window_layers": 0},
    "qwen2_moe": {"use_sliding_window": True, "max_window_layers": 0},
    "qwen3": {"use_sliding_window": True, "max_window_layers": 0},
    "qwen3_moe": {"use_sliding_window": True, "max_window_layers": 0},
    # Llama 4: a NoPE layer every 2nd (its temperature tuning and chunked attention both run in 2 layers)
    "llama4_text": {"no_rope_layer_interval": 2, "interleave_moe_layer_step": 1},
    # Gemma 2: softcapped attention logits are a refusal; the sweep checks the model that can run (the
    # refusal has its own test)
    "gemma2": {"attn_logit_softcapping": None},
    # per-layer input embeddings default to a 262k vocabulary (134M parameters): as small as the rest
    # (global layers' head dim 512 by default: fp32 sums over 512 put ring gradients at ~1.3x the tolerance)
    "gemma4_text": {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "global_head_dim": 32},
    "gemma3n_text": {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0},
    # GPT-Neo lists its layers as (kinds, repeats): one global, one local
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2, "window_size": WINDOW},
    # validators: MHA only (Dots3 Note), top-1 routing only (ZAYA), Mamba2 heads x head_dim = expand x hidden
    "dots3_note_text": {"num_key_value_heads": 4},
    "zaya": {"num_experts_per_tok": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "expand": 2, "chunk_size": 16},
    "nemotron_h": {"n_groups": 2, "chunk_size": 16},  # (its B / C groups must divide its 8 Mamba2 heads)
    # its blocks repeat (recurrent, recurrent, attention): 3 layers, so its local attention runs too
    "recurrent_gemma": {"num_hidden_layers": 3},
    # no default layer_types: one short-convolution and one attention layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # RoPE parameters keyed by layer type, none by default
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # the indexed (sparse) attention's indexer has no defaults
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 32,
                       "indexer_compress_ratio": 4},
    # Zamba: the shared attention block sits in layers derived from a period / id list, not from layer_types
    "zamba": {"layer_types": None, "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
              "attention_hidden_size": 128, "attention_head_dim": 32, "mamba_dt_rank": 8},
    "zamba2": {"layer_types": ["mamba", "hybrid"], "num_hidden_layers": 2, "hybrid_layer_ids": [1], "mamba_headdim": 16,
               "attention_hidden_size": 128, "attention_head_dim": 32, "kv_channels": 16, "num_query_groups": 4,
               "adapter_rank": 8, "chunk_size": 16},
    # DBRX keeps its attention and MoE settings in sub-configs
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
}


@dataclass(frozen=True)
class Family:
    """One entry of transformers' causal-LM mapping: swept (excluded is None) or excluded with the reason."""

    model_type: str
    model_class: str
    excluded: str | None = None


def _auto_maps() -> tuple[dict[str, str], Any]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), CONFIG_MAPPING


def _exclusion(model_type: str, model_class: str, seen_classes: dict[str, str], config_cls: Any) -> str | None:
    """Why an entry is not a decoder-only causal-LM family of its own (None: it is one)."""
    if model_class in seen_classes:
        return f"the same model class as {seen_classes[model_class]!r} ({model_class}), swept there"
    try:
        default = config_cls()
    except Exception:  # noqa: BLE001 - swept: its tiny config says whether it builds
        return None
    if getattr(default, "is_encoder_decoder", False):
        return f"encoder-decoder family ({model_class} is the decoder of a seq2seq model)"
    if model_class.endswith("ForConditionalGeneration"):
        return f"multimodal ({model_class}: needs a vision / audio tower); its text decoder is swept where listed"
    subs = sorted(getattr(config_cls, "sub_configs", None) or {})
    if any(any(w in s for w in _COMPOSITE_WORDS) for s in subs):
        return f"composite model ({', '.join(subs)}): not a decoder-only LM on its own; its text decoder is " \
               "swept where it has an entry"
    return None  # sub-configs of the decoder's own parts (DBRX, MPT: attention / FFN settings) are swept


@functools.cache
def families() -> tuple[Family, ...]:
    """Every entry of the installed transformers' causal-LM mapping, sorted by model type."""
    mapping, configs = _auto_maps()
    seen: dict[str, str] = {}
    out = []
    for model_type in sorted(mapping, key=lambda t: (not _own_type(t, mapping[t], configs), t)):
        model_class = mapping[model_type]
        if model_type not in configs:
            out.append(Family(model_type, model_class, "no config class registered for it"))
            continue
        why = _exclusion(model_type, model_class, seen, configs[model_type])
        if why is None:
            seen[model_class] = model_type
        out.append(Family(model_type, model_class, why))
    return tuple(sorted(out, key=lambda f: f.model_type))


def _own_type(model_type: str, model_class: str, configs: Any) -> bool:
    """Whether the config class is named like the model class (LlamaConfig, LlamaForCausalLM): the type a
    shared model class is swept under."""
    if model_type not in configs or getattr(configs[model_type], "model_type", None) != model_type:
        return False
    return model_class.lower().startswith(configs[model_type].__name__.removesuffix("Config").lower())


def _layer_kinds(default: Any) -> list[str] | None:
    """One layer of each kind the default config's layer_types lists (first-occurrence order), or None."""
    types = getattr(default, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(set(map(str, types))) < 2:
        return None
    return list(dict.fromkeys(str(t) for t in types))


def tiny_family_config(model_type: str) -> Any:
    """The tiny config of one family (rules above; the family's overrides last)."""
    _, configs = _auto_maps()
    cls = configs[model_type]
    default = cls()
    known = default.to_dict()
    amap = dict(getattr(cls, "attribute_map", {}) or {})
    kw: dict[str, Any] = {}
    for name, value in _TINY.items():
        real = amap.get(name, name)
        if real in known:
            kw[real] = value
    for name, value in known.items():
        if isinstance(value, float) and any(w in name for w in _ZERO_WORDS):
            kw[name] = 0.0
    if "qk_rope_head_dim" in known:  # MLA: head_dim is the rotary part of the qk head, and no GQA
        kw["head_dim"] = _TINY["qk_rope_head_dim"]
        kw[amap.get("num_key_value_heads", "num_key_value_heads")] = _TINY["num_attention_heads"]
    kinds = _layer_kinds(default)
    settable = amap.get("layer_types", "layer_types") == "layer_types" and not any(
        isinstance(getattr(cls, n, None), property) for n in ("layer_types", "layers_block_type"))
    if kinds is not None and settable:  # every layer kind once (sliding and full, ...)
        kw["layer_types"] = kinds
        kw[amap.get("num_hidden_layers", "num_hidden_layers")] = max(2, len(kinds))
    kw.update(_OVERRIDES.get(model_type, {}))
    if "layer_types" in kw and kw["layer_types"] is None:  # the override says: derived by the config itself
        del kw["layer_types"]
    return cls(**kw)
