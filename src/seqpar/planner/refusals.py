"""What `seqpar plan` refuses from a config before planning: models whose memory and time its formulas would get
wrong (vision towers, layer kinds and MoE blocks it does not model)."""

from __future__ import annotations

from typing import Any

from ..errors import SeqParError
from .families import FAMILY_TYPES
from .moe import MOE_TYPES
from .recurrent import layer_kinds

__all__ = ["refuse_unmodelled"]


def refuse_unmodelled(name: str, c: dict[str, Any]) -> None:
    """The planner's formulas are those of a dense softmax-attention decoder: anything else would be
    planned silently wrong, so it is refused with what is missing."""
    what = []
    if "vision_config" in c:
        what.append("a vision tower (vision_config)")
    text = c.get("text_config", c) if isinstance(c.get("text_config"), dict) else c
    if text.get("model_type") in FAMILY_TYPES and "vision_config" not in c:  # planner.families models them
        return
    known = ("full_attention", "attention", "chunked_attention", "linear_attention", "mamba", "mlp", "moe")
    types = layer_kinds(text)
    if any(t not in known and "sliding" not in str(t) for t in types):
        what.append(f"layer types it does not model ({sorted({str(t) for t in types if t not in known})})")
    experts = [text.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")]
    dense_blocks = "mlp" in types and "moe" not in types  # Nemotron-H lists its MLP blocks: no expert is used
    modelled = text.get("model_type") in MOE_TYPES  # planner.moe: its MoE block in every layer
    if "moe" in types or (any(isinstance(e, int) and e > 1 for e in experts) and not dense_blocks and not modelled):
        what.append("mixture-of-experts MLPs")
    if "vision_config" in c and len(what) == 1:
        raise SeqParError(
            f"model {name!r} is a vision-language model: seqpar plan models the text decoder only, and the vision "
            "tower's memory depends on the images / videos per sample (each one encoded once per SP group: a rank "
            "holds the tower's activations for about 1/SP of the batch's patches, plus its weights). Plan the decoder "
            "with its text config (save config['text_config'] as a JSON file with model_type 'qwen2' for Qwen2.5-VL, "
            "'qwen3' for Qwen3-VL: the same decoder, and pass it to --model) at --seq-len = "
            "text + vision tokens (one per merged patch: t*h*w / spatial_merge_size**2 per image or video), then "
            "leave room for the tower: measure a short run with `seqpar train` (metrics.jsonl peak_alloc_mb per step)"
        )
    if what:
        raise SeqParError(
            f"model {name!r} has {' and '.join(what)}: seqpar plan models dense decoders (Llama / Qwen2 / Qwen3 / "
            "Mistral-like, hybrids whose layers each hold softmax attention or Gated DeltaNet / Mamba2 plus a "
            "dense MLP: Qwen3.5, Granite 4, Bamba, and Nemotron-H's blocks of one mixer or one dense MLP; the "
            f"MoE MLPs of {', '.join(MOE_TYPES)}; the hybrid families {', '.join(FAMILY_TYPES)}); its memory and "
            "time would be wrong for this model. "
            "Measure it instead (seqpar train with `memory:` features logs peak memory per step)"
        )
