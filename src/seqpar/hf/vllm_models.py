"""Which models the vLLM rollout engine (seqpar.hf.vllm_engine) takes, and the config vLLM is built from.

`check_vllm_model` refuses, in one line before any rank starts, what the engine cannot run: no vLLM, an architecture
vLLM does not have, a vision-language model, a head_dim vLLM's CPU attention refuses, and on CPU the hybrid families
(recurrent layers beside or instead of attention) that vLLM 0.32's CPU engine was found not to run exactly here,
each with the reason found (tests/vllm_env/test_vllm_hybrids.py runs the ones it takes and checks the refusals).
On CUDA nothing of this engine has run yet: only the architecture and VLM checks apply there.
"""

from __future__ import annotations

import copy
from typing import Any

from ..errors import SeqParError

__all__ = ["architectures", "check_tensor_parallel", "check_vllm_model", "config_for_vllm", "engine_options",
           "head_dim", "vllm_available"]

_UNTRIED = "not tried with vLLM 0.32's CPU engine here yet"
_GDN_BF16 = "vLLM 0.32's CPU Gated DeltaNet kernel runs in bf16 only ('CPU GDN attention requires BF16'), and the " \
            "engine runs in the policy's dtype"
_QWEN35 = "vLLM 0.32's Qwen3.5 classes import its vision module, which needs torchvision (the vLLM CPU " \
          "environment has none: its CUDA build does not import against the CPU torch)"
_MAMBA1 = "vLLM 0.32's CPU build has no Mamba1 selective-scan kernel: its engine starts and takes the weights, then " \
          "the first rollout fails ('torch.ops._C' has no attribute 'selective_scan_fwd')"
# Hybrid families by model_type on vLLM 0.32's CPU engine: None = runs (the engine's log-probs after a push equal
# transformers'), else why it is refused. A hybrid model_type missing here is refused as untried.
CPU_HYBRIDS: dict[str, str | None] = {
    "falcon_h1": None,
    "qwen3_next": _GDN_BF16,
    "olmo_hybrid": "not run here, but its linear layers are vLLM 0.32's Gated DeltaNet class, whose CPU kernel runs in "
                   "bf16 only (found with Qwen3-Next), and the engine runs in the policy's dtype",
    "qwen3_5_text": _QWEN35, "qwen3_5_moe_text": _QWEN35, "qwen3_5": _QWEN35, "qwen3_5_moe": _QWEN35,
    "lfm2": None,
    "nemotron_h": "vLLM 0.32 does not start it on CPU: its MoE experts are not gated ('is_act_and_mul=False is "
                  "supported only for CUDA, XPU and ROCm')",
    "granitemoehybrid": "vLLM 0.32's Granite 4 class loads the checkpoints' MoE names (block_sparse_moe.router.layer, "
                        "input_linear, output_linear), not transformers 5's that the push streams (router, "
                        "experts.gate_up_proj / down_proj): the first push failed (KeyError "
                        "'layers.0.block_sparse_moe.router.weight')",
    "kimi_linear": "vLLM 0.32 does not start it on CPU (\"AttributeError: '_lib_fn_wrapper' object has no attribute "
                   "'get'\")",
    "zamba2": "vLLM 0.32's Zamba2 on CPU is not exact here: after a push its log-probs were 5e-5, after a second 2e-4 "
              "apart from transformers' for the same weights (tiny model, fp32, tied embeddings; the bar is 1e-4)",
    "jamba": _MAMBA1, "mamba": _MAMBA1,
    "falcon_mamba": "not run here, but it is vLLM 0.32's Mamba class, which failed at the first rollout with Mamba: "
                    + _MAMBA1,
}
_ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def head_dim(c: Any) -> int:
    hd = getattr(c, "head_dim", None)
    return int(hd) if hd else int(c.hidden_size) // int(c.num_attention_heads)


def architectures(config: Any) -> list[str]:
    """The config's architectures, or the causal-LM class transformers maps its model_type to (tiny configs)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(config, "architectures", None) or [])
    if not archs and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type):
        archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return archs


def config_for_vllm(config: Any) -> Any:
    """A copy of the config as vLLM reads it: its architectures set (tiny configs have none), and the fields vLLM's
    model classes read that transformers' config classes no longer carry (checkpoints' config.json files do):
    LFM2's conv_dim and block_dim (transformers' short convolution and MLP are hidden_size wide)."""
    config = copy.deepcopy(config)
    config.architectures = architectures(config)
    if config.model_type == "lfm2":
        for field in ("conv_dim", "block_dim"):
            if getattr(config, field, None) is None:
                setattr(config, field, int(config.hidden_size))
    return config


# vLLM's classes for these hand its rotary embedding q / k as (tokens, heads, head_dim); its CPU rotary kernel
# rotates only (tokens, heads * head_dim) right (3-D: wrong even at position 0), its torch path both.
_ROPE_3D = frozenset({"lfm2"})
# vLLM's classes for these tie lm_head to the embeddings whatever the config says.
_ALWAYS_TIED = frozenset({"lfm2", "zamba2"})


def engine_options(config: Any, on_cuda: bool) -> dict[str, Any]:
    """Extra vLLM engine arguments this model needs: on CPU, the torch rotary embedding for _ROPE_3D."""
    if not on_cuda and config.model_type in _ROPE_3D:
        return {"compilation_config": {"custom_ops": ["-rotary_embedding"]}}
    return {}


def _is_hybrid(c: Any) -> bool:
    types = getattr(c, "layer_types", None) or getattr(c, "layers_block_type", None) or ()
    return c.model_type in CPU_HYBRIDS or any(str(t) not in _ATTENTION_KINDS for t in types)


def _cpu_refusal(c: Any, instead: str, tiny_hint: str) -> str | None:
    """Why vLLM's CPU engine cannot take this text config, and the fix (None: it can)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    why = CPU_HYBRIDS.get(c.model_type, _UNTRIED) if _is_hybrid(c) else None
    if why is not None:
        return f"the hybrid model {c.model_type!r} on CPU: {why}: use {instead} for this model"
    experts = any(getattr(c, f, None) for f in ("num_experts", "num_local_experts", "n_routed_experts"))
    width = getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None)
    if experts and c.model_type != "gpt_oss" and width and int(width) % 32:
        return (f"the experts' intermediate size {width} is not a multiple of 32: vLLM 0.32's CPU MoE pads it and "
                "its in-place weight reload (every push) then fails on the padded shape: use a model whose is (a "
                f"tiny model: {tiny_hint.replace('head_dim', 'moe_intermediate_size')}), or {instead}")
    ok = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim(c) not in ok:
        return (f"head_dim={head_dim(c)} is not one vLLM's CPU attention runs ({', '.join(map(str, ok))}): use a "
                f"model with one of those (a tiny model: {tiny_hint}), or {instead}")
    return None


def check_vllm_model(config: Any, on_cuda: bool, option: str = "grpo.rollout.engine: vllm",
                     instead: str = "engine: transformers", tiny_hint: str = "model.kwargs.head_dim: 32",
                     tensor_parallel: int = 1) -> None:
    """Refuse (one line, before any rank starts) what the vLLM engine cannot run (the module docstring).
    option / instead / tiny_hint: the trainer's names for the engine, the way back and a tiny model's head_dim."""
    if not vllm_available():
        raise SeqParError(f"{option} needs vLLM, which this environment lacks: build its "
                          f"environment with `make vllm-env` and run with .venv-vllm/bin/python (or use {instead})")
    if config is None:
        raise SeqParError(f"{option} needs the model's HF config (model.name 'smollm2' is a GGUF "
                          f"file): use a local HF model directory or tiny:<arch>, or {instead}")
    if getattr(config, "vision_config", None) is not None:
        raise SeqParError(f"{option} does not take vision-language models yet (the engine gets "
                          f"token ids only, no images): use {instead}")
    from vllm.model_executor.models import ModelRegistry

    archs = architectures(config)
    known = set(ModelRegistry.get_supported_archs())
    if not archs or not any(a in known for a in archs):
        raise SeqParError(f"{option}: vLLM has no architecture {archs or config.model_type!r}: use "
                          f"{instead} for this model")
    if config.model_type in _ALWAYS_TIED and not getattr(config, "tie_word_embeddings", True):
        raise SeqParError(f"{option}: vLLM 0.32's {config.model_type!r} class always ties lm_head to the embeddings, "
                          "and this model's tie_word_embeddings is False (its own lm_head would be dropped): use a "
                          f"tied model (a tiny model: model.kwargs.tie_word_embeddings: true), or {instead}")
    why = None if on_cuda else _cpu_refusal(config, instead, tiny_hint)
    if why:
        raise SeqParError(f"{option}: {why}")
    if tensor_parallel > 1:
        check_tensor_parallel(config, tensor_parallel)


def check_tensor_parallel(config: Any, tp: int) -> None:
    """vLLM's tensor-parallel layers split the attention heads and the MLP's columns evenly over the TP ranks and
    split (or, when fewer than the ranks, replicate) the KV heads: what does not divide is refused here, not by
    an assertion inside every rank's engine."""
    c = getattr(config, "text_config", None) or config
    nh = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or nh)
    sizes = [("num_attention_heads", nh, nh % tp == 0),
             ("num_key_value_heads", kv, kv % tp == 0 or tp % kv == 0)]
    inter = getattr(c, "intermediate_size", None)
    if isinstance(inter, int):
        sizes.append(("intermediate_size", inter, inter % tp == 0))
    for name, n, ok in sizes:
        if not ok:
            raise SeqParError(f"grpo.rollout.tensor_parallel={tp} (the SP group): vLLM cannot split the model's "
                              f"{name}={n} over {tp} ranks: set grpo.rollout.tensor_parallel: 1 (one engine per "
                              f"rank)")
