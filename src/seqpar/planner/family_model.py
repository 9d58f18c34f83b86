"""ModelFacts of the hybrid families planner.families describes (LFM2 / LFM2-MoE / LFM3, Jamba, Falcon-Mamba,
Mamba, Falcon-H1, Zamba2, OLMo-hybrid, Kimi-Linear, MiniMax): the attention fields the rest of the planner reads,
the recurrent mixer's facts (planner.recurrent / planner.recurrent_kinds) and the per-layer shapes."""

from __future__ import annotations

from typing import Any

from ..errors import SeqParError
from .families import family_facts
from .recurrent import recurrent_facts
from .recurrent_kinds import new_kind_facts

__all__ = ["family_model_facts"]


def _recurrent(name: str, model_type: str, c: dict[str, Any]) -> Any:
    rec = new_kind_facts(model_type, c)
    if rec is None:  # Falcon-H1 / Zamba2 (Mamba2), OLMo-hybrid (Gated DeltaNet)
        rec = recurrent_facts(name, c, ["linear_attention"])
    return rec


def family_model_facts(name: str, c: dict[str, Any], hf: Any, attn: dict[str, Any], qk_norm: bool) -> Any:
    """ModelFacts of a planner.families model from its text config dict `c`, the transformers config `hf` and the
    attention fields planner.model read (spans, MLA)."""
    from .model import ModelFacts

    model_type = str(c["model_type"])
    try:
        rec = _recurrent(name, model_type, c)
        fam = family_facts(model_type, hf, rec)
        hidden = int(hf.hidden_size)
        heads = int(getattr(hf, "num_attention_heads", None) or 1)  # Mamba / Falcon-Mamba: no attention
        kv = int(getattr(hf, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf, "attention_head_dim", None) or getattr(hf, "head_dim", None) or hidden // heads)
    except (KeyError, AttributeError) as e:
        raise SeqParError(f"model config {name!r} ({model_type}) lacks {e.args[0]!r}: give the model's "
                          "config.json") from None
    if model_type == "zamba2":  # the shared block's attention reads [x, embeddings]: its q is wider than hidden
        attn = {**attn, "head_dim": head_dim}
    attn.setdefault("head_dim", head_dim)
    moe = fam.moe if all(lay.mlp == "moe" for lay in fam.layers) else None
    return ModelFacts(
        name=name, model_type=model_type, hidden=hidden, layers=len(fam.layers), heads=heads, kv_heads=kv,
        intermediate=fam.dense_intermediate, vocab=int(hf.vocab_size), tied=bool(getattr(hf, "tie_word_embeddings",
                                                                                       False)),
        max_positions=getattr(hf, "max_position_embeddings", None), qk_norm=qk_norm, recurrent=rec,
        linear_index=tuple(i for i, lay in enumerate(fam.layers) if lay.recurrent), moe=moe, family=fam, **attn)
