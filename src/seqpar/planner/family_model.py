"""ModelFacts' fields for the hybrid families planner.families describes (LFM2 / LFM2-MoE / LFM3, Jamba, Falcon-Mamba,
Mamba, Falcon-H1, Zamba2, OLMo-hybrid, Kimi-Linear, MiniMax, RecurrentGemma): the attention fields the rest of the
planner reads, the recurrent mixer's facts (planner.recurrent / planner.recurrent_kinds) and the per-layer shapes."""

from __future__ import annotations

from typing import Any

from ..errors import SeqParError
from .families import family_facts
from .recurrent import RecurrentFacts, recurrent_facts
from .recurrent_kinds import KDA_CHUNK

__all__ = ["family_model_facts", "new_kind_facts"]


def _int(c: dict[str, Any], *names: str, default: int | None = None) -> int:
    v = next((c[n] for n in names if c.get(n) is not None), default)
    if v is None:
        raise KeyError(names[0])
    return int(v)


def new_kind_facts(model_type: str, c: dict[str, Any]) -> Any:
    """The recurrent facts of a family whose mixer is one of NEW_KINDS (None for the others)."""
    h = int(c["hidden_size"])
    if model_type in ("lfm2", "lfm2_moe", "lfm3"):
        return RecurrentFacts("short_conv", h, h, 1, 1, 1, _int(c, "conv_L_cache", default=3), 1,
                              bias=bool(c.get("conv_bias", False)))
    if model_type in ("jamba", "falcon_mamba", "mamba"):
        if model_type == "jamba":
            d = _int(c, "mamba_expand", default=2) * h
            n, k, r = _int(c, "mamba_d_state", default=16), _int(c, "mamba_d_conv", default=4), c.get("mamba_dt_rank")
            bias, norms = bool(c.get("mamba_conv_bias", True)), 2
        else:
            d = _int(c, "intermediate_size", default=_int(c, "expand", default=2) * h)
            n, k, r = _int(c, "state_size", default=16), _int(c, "conv_kernel", default=4), c.get("time_step_rank")
            bias, norms = bool(c.get("use_conv_bias", True)), 1 if model_type == "falcon_mamba" else 0
        r = -(-h // 16) if r in (None, "auto") else int(r)
        return RecurrentFacts("mamba1", d, d, n, 1, 1, k, 1, extra=r, bias=bias, norms=norms)
    if model_type == "kimi_linear":
        heads, d = _int(c, "linear_num_heads"), _int(c, "linear_head_dim")
        return RecurrentFacts("kda", heads, heads, d, d, 1, _int(c, "linear_conv_kernel_dim", default=4), KDA_CHUNK)
    if model_type == "minimax":
        heads = _int(c, "num_attention_heads")
        d = _int(c, "head_dim", default=h // heads)
        return RecurrentFacts("lightning", heads, heads, d, d, 1, 1, _int(c, "block_size", default=256))
    if model_type == "recurrent_gemma":  # RG-LRU: lru_width channels in num_attention_heads gate blocks
        heads = _int(c, "num_attention_heads", default=10)
        b = _int(c, "lru_width", default=h) // heads
        return RecurrentFacts("rglru", heads, heads, b, b, 1, _int(c, "conv1d_width", default=4), 1, bias=True)
    return None


def _recurrent(name: str, model_type: str, c: dict[str, Any]) -> Any:
    rec = new_kind_facts(model_type, c)
    if rec is None:  # Falcon-H1 / Zamba2 (Mamba2), OLMo-hybrid (Gated DeltaNet)
        rec = recurrent_facts(name, c, ["linear_attention"])
    return rec


def family_model_facts(name: str, c: dict[str, Any], hf: Any, attn: dict[str, Any], qk_norm: bool) -> Any:
    """ModelFacts' fields of a planner.families model from its text config dict `c`, the transformers config `hf`
    and the attention fields planner.model read (spans, MLA)."""
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
    return dict(
        name=name, model_type=model_type, hidden=hidden, layers=len(fam.layers), heads=heads, kv_heads=kv,
        intermediate=fam.dense_intermediate, vocab=int(hf.vocab_size), tied=bool(getattr(hf, "tie_word_embeddings",
                                                                                       False)),
        max_positions=getattr(hf, "max_position_embeddings", None), qk_norm=qk_norm, recurrent=rec,
        linear_index=tuple(i for i, lay in enumerate(fam.layers) if lay.recurrent), moe=moe, family=fam, **attn)
