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
from .load import model_config

__all__ = ["check_model", "refuse_unsupported_model", "max_token_id"]

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


def _refuse_non_causal(c: Any, name: str) -> None:
    from transformers import AutoModelForCausalLM

    from ...hf.attention import _check_config
    from ...hf.vision import check_vlm

    if is_vlm(c):  # vision-language: a supported Qwen VL, its text decoder checked like any causal LM
        _check_config(check_vlm(c))
        return
    _check_config(c)
    try:
        with torch.device("meta"):  # structure only: no memory, no weights
            model = AutoModelForCausalLM.from_config(c)
    except ValueError as e:
        raise SeqParError(f"model.name={name!r} is not a causal LM ({str(e).splitlines()[0][:120]}): seqpar trains "
                          f"causal LMs (AutoModelForCausalLM) only") from None
    bad = sorted({type(m).__name__ for m in model.modules() if getattr(m, "is_causal", True) is False})
    if bad:
        raise SeqParError(f"model.name={name!r} has non-causal attention ({', '.join(bad)}: is_causal=False): "
                          f"seqpar supports causal LMs only (for BERT-like configs: is_decoder=True)")


def refuse_unsupported_model(cfg: TrainConfig) -> Any | None:
    """What the SP model would refuse, from the config alone; returns the config (None: smollm2)."""
    c = model_config(cfg)
    if c is not None:
        _refuse_non_causal(c, cfg.model.name)
    if is_vlm(c) and cfg.fsdp:
        # FSDP2 gathers a unit's parameters collectively, but only the ranks that own an image run the vision
        # tower (seqpar.hf.vision): the others would never join that gather.
        raise SeqParError("fsdp: true with a vision-language model is not supported (each image is encoded on one "
                          "SP rank only): set fsdp: false")
    return c


def check_model(cfg: TrainConfig, examples: list) -> None:
    """The model is a supported causal LM, and the examples fit its vocabulary and positions."""
    c = refuse_unsupported_model(cfg)
    c = c.text_config if is_vlm(c) else c
    limits = SMOLLM2_LIMITS if c is None else {
        "vocab_size": int(c.vocab_size), "max_position_embeddings": getattr(c, "max_position_embeddings", None)}
    top = max_token_id(examples)
    if top >= limits["vocab_size"]:
        raise SeqParError(f"the dataset has token id {top} but the model's vocabulary has {limits['vocab_size']} "
                          f"ids: tokenize with the model's tokenizer (or fix the tokenized rows)")
    n_pos = limits["max_position_embeddings"]
    if n_pos is not None and cfg.dataset.max_length > int(n_pos):
        raise SeqParError(f"dataset.max_length={cfg.dataset.max_length} exceeds the model's max_position_embeddings="
                          f"{n_pos}: use max_length <= {n_pos}")
