"""Checks of the model against the run, from its config alone (no weights): what `seqpar train` would
refuse later -- non-causal attention, token ids outside the vocabulary, max_length beyond the model's
positions -- refused by `seqpar check` and before launch (and at the start of `train`), on every rank alike.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import SeqParError
from ...hf.vision import is_vlm
from ..config import TrainConfig
from .load import ModelInfo, model_info

__all__ = ["check_model", "refuse_unsupported_model", "refuse_non_causal", "max_token_id", "position_limit",
           "refuse_bad_attention_spans", "refuse_bad_sinks"]

# SmolLM2-135M-Instruct (bundled GGUF): read its config from the constants instead of the 100 MB file.
SMOLLM2_LIMITS = {"vocab_size": 49152, "max_position_embeddings": 8192}


def max_token_id(examples: list) -> int:
    """Largest token id in tokenized examples (rows, packs of rows, DPO pairs, GRPO prompts)."""
    best = -1
    stack = list(examples)
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(v for k, v in x.items() if k != "labels")
        elif isinstance(x, list) and x and isinstance(x[0], int):
            best = max(best, max(x))
        elif isinstance(x, list):
            stack.extend(x)
        elif hasattr(x, "prompt_ids"):  # GRPO prompt rows (seqpar.train.dataset.prompts)
            stack.append(x.prompt_ids)
    return best


def refuse_non_causal(c: Any, name: str) -> None:
    """SeqParError unless the HF config `c` (model.name `name`) builds a causal LM seqpar's attention runs."""
    from transformers import AutoModelForCausalLM

    from ...hf.attention import check_attention_interface, check_config
    from ...hf.vision import check_vlm

    if is_vlm(c):  # vision-language: a supported Qwen VL, its text decoder checked like any causal LM
        check_config(check_vlm(c))
        refuse_bad_attention_spans(check_vlm(c), name)
        return
    check_config(c)
    refuse_bad_attention_spans(c, name)
    try:
        with torch.device("meta"):  # structure only: no memory, no weights
            model = AutoModelForCausalLM.from_config(c)
    except ValueError as e:
        raise SeqParError(f"model.name={name!r} is not a causal LM ({str(e).splitlines()[0][:120]}): seqpar trains "
                          f"causal LMs (AutoModelForCausalLM) only") from None
    try:  # (a heterogeneous config, Gemma 4's, refuses a global read of a per-layer value: no single head count)
        heads = getattr(c, "num_attention_heads", None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        heads = None
    if isinstance(heads, int):
        refuse_bad_sinks(model, heads, name)
    bad = sorted({type(m).__name__ for m in model.modules() if getattr(m, "is_causal", True) is False})
    if bad:
        raise SeqParError(f"model.name={name!r} has non-causal attention ({', '.join(bad)}: is_causal=False): "
                          f"seqpar supports causal LMs only (for BERT-like configs: is_decoder=True)")
    check_attention_interface(model, c)  # attention computed outside transformers' AttentionInterface


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def refuse_bad_attention_spans(c: Any, name: str) -> None:
    """A (text) config's sliding_window and attention_chunk_size must be positive whole numbers: seqpar's attention
    reads both per layer (windows in reach, chunks). A window wider than the positions the model takes (Phi-3-mini-128k
    ships 262144 over 131072 positions) never masks a key: full attention, as the unsharded model computes."""
    window, chunk = getattr(c, "sliding_window", None), getattr(c, "attention_chunk_size", None)
    if window is not None and not _whole(window):
        raise SeqParError(f"model.name={name!r}: config.sliding_window={window!r} is not a positive whole number of "
                          "tokens: set model.kwargs.sliding_window to one (or null: full attention in every layer)")
    if chunk is not None and not _whole(chunk):
        raise SeqParError(f"model.name={name!r}: config.attention_chunk_size={chunk!r} is not a positive whole number "
                          "of tokens: set model.kwargs.attention_chunk_size to one")


def refuse_bad_sinks(model: torch.nn.Module, heads: int, name: str) -> None:
    """Attention sinks (gpt-oss: one learned logit per q head, `sinks` of the attention modules) in a shape seqpar's
    attention can read: [num_attention_heads]."""
    for path, module in model.named_modules():
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor) and tuple(sinks.shape) != (heads,):
            raise SeqParError(f"model.name={name!r}: {path or type(module).__name__}.sinks has shape "
                              f"{list(sinks.shape)}, but seqpar's attention reads one sink logit per q head, "
                              f"[num_attention_heads] = [{heads}]: give the model sinks of that shape")


def _rope_dicts(c: Any) -> list[dict]:
    """The config's RoPE parameter dicts: one, or one per layer type (e.g. Gemma 3)."""
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    return list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]


def refuse_unsupported_model(cfg: TrainConfig, info: ModelInfo | None = None) -> Any | None:
    """What the SP model would refuse, from the config alone; returns the config (None: smollm2)."""
    c = (info or model_info(cfg)).config
    text = c.text_config if is_vlm(c) else c
    if text is not None and any("rope_theta" in p and p["rope_theta"] is None for p in _rope_dicts(text)):
        # transformers 5: a rope_scaling / rope_parameters kwarg replaces the whole dict, rope_theta included
        raise SeqParError("model.kwargs replace the config's RoPE parameters without rope_theta (the model would "
                          "not build): give rope_parameters with rope_type, factor and rope_theta")
    if c is not None:
        refuse_non_causal(c, cfg.model.name)
    return c


def check_model(cfg: TrainConfig, examples: list, info: ModelInfo | None = None) -> None:
    """The model is a supported causal LM, and the examples fit its vocabulary and positions."""
    c = refuse_unsupported_model(cfg, info)
    c = c.text_config if is_vlm(c) else c
    vocab = SMOLLM2_LIMITS["vocab_size"] if c is None else int(c.vocab_size)
    top = max_token_id(examples)
    if top >= vocab:
        raise SeqParError(f"the dataset has token id {top} but the model's vocabulary has {vocab} "
                          f"ids: tokenize with the model's tokenizer (or fix the tokenized rows)")
    smol = SMOLLM2_LIMITS["max_position_embeddings"]
    limit, why = (smol, f"max_position_embeddings={smol}") if c is None else position_limit(c)
    if limit is not None and cfg.dataset.max_length > limit:
        raise SeqParError(f"dataset.max_length={cfg.dataset.max_length} exceeds the model's {why}: use max_length "
                          f"<= {limit}, or extend the positions in model.kwargs (max_position_embeddings, "
                          f"rope_scaling)")


def position_limit(c: Any) -> tuple[int | None, str]:
    """The longest sequence the config's positions cover, and what says so: max_position_embeddings, or more
    where RoPE scaling extends it (factor x original_max_position_embeddings, or x max_position_embeddings
    when the config names no original: linear / dynamic). Per-layer-type RoPE (e.g. Gemma 3): the smallest."""
    n = getattr(c, "max_position_embeddings", None)
    if n is None:
        return None, "positions (no max_position_embeddings)"
    n = int(n)
    plain = (n, f"max_position_embeddings={n}")
    params = _rope_dicts(c)
    best = []
    for p in params:
        kind, f = p.get("rope_type", p.get("type", "default")), p.get("factor")
        if kind == "default" or not f or float(f) <= 1:
            best.append(plain)
            continue
        base = int(p.get("original_max_position_embeddings") or n)
        ext = int(base * float(f))
        best.append(plain if ext <= n else
                    (ext, f"positions under rope_scaling ({kind}, factor {float(f):g} x {base})={ext}"))
    return min(best) if best else plain
