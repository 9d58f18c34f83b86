"""Find what mixes information along the sequence OUTSIDE softmax attention, so SP can refuse it.

seqpar shards the sequence and makes only the attention function see the whole of it. Anything
else that looks along the sequence (linear attention / Gated DeltaNet, Mamba / SSM scans, causal
convolutions, recurrences such as RWKV, xLSTM or RG-LRU) would run on the
local shard alone and silently give wrong results. Three independent signals, any one suffices:
- structure: `nn.Conv1d` with a kernel longer than 1 (a convolution along the sequence), `nn.RNNBase`;
- class names of the known families (GatedDeltaNet, Mamba, SSM, Mixer, Recurrent, RWKV, xLSTM,
  LinearAttention, LightningAttention, ShortConv, ...);
- the config: `layer_types` entries that are not softmax attention ("linear_attention", "mamba",
  "conv", "hybrid", ...), `layers_block_type`, an `attention_chunk_size` without `layer_types`.
The layers of seqpar.hf.recurrent_layers (Gated DeltaNet, KDA, Mamba2, Mamba1, lightning attention, the RG-LRU,
LFM2's short convs) are the exception: seqpar runs them (Ulysses, ring, USP), and apply_sequence_parallel passes
them here as `supported`.
Sliding-window and chunked attention (Llama 4's 'chunked_attention' layers) are softmax attention with another
mask: seqpar's attention runs them (attention.pieces).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import SeqParError

__all__ = ["ATTENTION_LAYER_TYPES", "find_sequence_mixers", "check_softmax_attention_only"]

# layer_types values that are plain softmax attention (full or sliding window), or per-token blocks that mix
# nothing along the sequence (Nemotron-H lists its MLP / MoE blocks as layers).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention", "global",
                                   "local", "mlp", "moe"})
_MIXER_NAMES = re.compile(
    r"GatedDeltaNet|DeltaNet|Mamba|SSM|Ssm|Mixer|Recurrent|Rglru|RWKV|Rwkv|xLSTM|mLSTM|sLSTM|LinearAttention|"
    r"LinearAttn|LightningAttention|ShortConv|Hyena|Retention"
)


# Per-token building blocks whose class name may contain a family name (MambaRMSNormGated, ...).
_PER_TOKEN_NAMES = re.compile(r"Norm|MLP|Embedding|Rotary|Expert|Router|Moe|FeedForward|Activation")


def _family(model: torch.nn.Module) -> str:
    """'Mamba' for MambaForCausalLM: the prefix every class of a transformers model family shares."""
    m = re.match(r"(.+?)(ForCausalLM|LMHeadModel|ForConditionalGeneration|Model)$", type(model).__name__)
    return m.group(1) if m else type(model).__name__


def _module_reason(module: torch.nn.Module, family: str) -> str | None:
    if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
        return f"Conv1d with kernel size {module.kernel_size[0]} (a convolution along the sequence)"
    if isinstance(module, torch.nn.RNNBase):
        return "a recurrent layer"
    name = type(module).__name__
    # Match the part after the family prefix: every class of RecurrentGemma / Rwkv contains the family name.
    rest = name[len(family):] if name.startswith(family) else name
    if _MIXER_NAMES.search(rest) and not _PER_TOKEN_NAMES.search(rest):
        return f"{name} (linear attention / state-space / recurrent / convolutional sequence mixer)"
    return None


def _config_reasons(cfg: Any, allowed_types: frozenset[str] = frozenset()) -> list[str]:
    reasons = []
    ok = ATTENTION_LAYER_TYPES | allowed_types
    for attr in ("layer_types", "layers_block_type"):
        types = getattr(cfg, attr, None)
        if isinstance(types, (list, tuple)):
            other = sorted({str(t) for t in types if str(t) not in ok})
            if other:
                reasons.append(f"config.{attr} has non-softmax-attention layers {other}")
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None and not isinstance(getattr(cfg, "layer_types", None), (list, tuple)):
        # seqpar finds a chunked layer through config.layer_types ('chunked_attention', as Llama 4 lists them)
        reasons.append(f"config.attention_chunk_size={chunk} without config.layer_types (chunked local attention)")
    return reasons


def find_sequence_mixers(
    model: torch.nn.Module, cfg: Any, supported: tuple[torch.nn.Module, ...] = (),
    supported_types: frozenset[str] = frozenset(),
) -> list[str]:
    """Descriptions of every non-softmax-attention sequence mixer found (empty: softmax attention only).

    One entry per class, with the first module path where it occurs; config findings first.
    `supported`: mixer modules seqpar runs itself (seqpar.hf.linear_attention), skipped with their
    submodules; `supported_types`: the config layer_types values those modules implement.
    """
    found = _config_reasons(cfg, supported_types)
    family = _family(model)
    if _MIXER_NAMES.search(family) and not supported:  # with its mixers supported, the module scan decides
        found.append(f"{type(model).__name__}: a {family} model (a non-attention model family)")
    seen: set[type] = set()
    skip = {id(m) for s in supported for m in s.modules()}
    holders = {id(m) for m in model.modules() if any(id(c) in skip for c in m.modules())}
    for path, module in model.named_modules():
        if type(module) in seen or id(module) in skip:
            continue
        if id(module) in holders and not isinstance(module, (torch.nn.Conv1d, torch.nn.RNNBase)):
            continue  # a block holding a supported mixer (Zamba2MambaDecoderLayer): named after it, its own children
        reason = _module_reason(module, family)
        if reason is not None:
            seen.add(type(module))
            found.append(f"{path or '<root>'}: {reason}")
    return found


def check_softmax_attention_only(
    model: torch.nn.Module, cfg: Any, supported: tuple[torch.nn.Module, ...] = (),
    supported_types: frozenset[str] = frozenset(),
) -> None:
    """Raise SeqParError if the model mixes along the sequence anywhere but in softmax attention
    (or in the `supported` mixer modules, see find_sequence_mixers)."""
    found = find_sequence_mixers(model, cfg, supported, supported_types)
    if found:
        listed = "; ".join(found[:6]) + ("; ..." if len(found) > 6 else "")
        raise SeqParError(
            f"{type(model).__name__} mixes information along the sequence outside softmax attention ({listed}). "
            "seqpar supports softmax-attention models only: these layers would see only their rank's shard and "
            "give silently wrong results. Use a softmax-attention model (Llama, Qwen2/3, Mistral, Gemma2/3, "
            "Phi3, ...) or a supported hybrid (Qwen3-Next, Qwen3.5 text, OLMo-hybrid: Gated DeltaNet; Kimi-Linear: "
            "KDA; Nemotron-H, Granite 4 (GraniteMoeHybrid), Bamba, Falcon-H1, Zamba2: Mamba2; Jamba, Falcon-Mamba, "
            "Mamba: Mamba1; MiniMax: lightning attention; RecurrentGemma: RG-LRU; LFM2: short convolutions), or "
            "train without SP"
        )
