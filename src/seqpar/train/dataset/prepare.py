"""A run's dataset as training examples: rows read, normalised, tokenized with the model's tokenizer and
packed (SFT / DPO), chat rows or DPO pairs with images for vision-language models, or GRPO prompt rows; with the
counts of what was truncated or dropped. Every dataset check runs here, before any process group.
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import SeqParError
from ..config import DatasetSpec, TrainConfig
from ..model.load import ModelInfo, load_tokenizer, model_info
from .images import VisionSpec, build_vision_dpo_examples, build_vision_examples, refuse_media_rows
from .prompts import load_prompts
from .tokenize import build_examples, load_rows

__all__ = ["prepare_examples"]


def prepare_examples(cfg: TrainConfig, tok: Any = None, spec: DatasetSpec | None = None,
                     info: ModelInfo | None = None) -> tuple[list, dict[str, int]]:
    """Tokenized (and packed) examples of `spec` (default: cfg.dataset) + stats; every dataset check runs here.
    info: the run's model config (default: read here)."""
    tok = tok if tok is not None else load_tokenizer(cfg)
    if cfg.stage == "grpo" and spec is None:
        return load_prompts(cfg, tok, info or model_info(cfg))  # prompt rows (dataset/prompts.py)
    d = spec if spec is not None else cfg.dataset
    what = "dataset" if spec is None else "eval_dataset"
    rows = load_rows(d.path, what)
    info = info or model_info(cfg)
    try:
        if info.vlm:
            return vision_examples(cfg, d, rows, tok, info.config)
        refuse_media_rows(rows)  # a text-only model would drop the media and train their placeholders as text
        return build_examples(rows, d.format, cfg.stage, tok, d.max_length, d.packing,
                              train_on_prompt=d.train_on_prompt, mask_history=d.mask_history,
                              max_prompt_length=d.max_prompt_length, truncation_mode=d.truncation_mode)
    except SeqParError as e:  # row errors: say which file (dataset or eval_dataset); rows are 1-based lines
        raise SeqParError(f"{what} {d.path}: {e}") from None


def vision_examples(cfg: TrainConfig, d: DatasetSpec, rows: list, tok: Any, mc: Any) -> tuple[list, dict[str, int]]:
    """Chat rows with images / videos for a vision-language model (dataset/images.py): SFT, packed or not; DPO
    pairs whose prompts carry the media (GRPO prompts: dataset/prompts.py)."""
    spec = VisionSpec.from_model_config(mc, cfg.model.name)
    base = os.path.dirname(os.path.abspath(d.path))
    if cfg.stage == "dpo":
        return build_vision_dpo_examples(rows, d.format, tok, spec, d.max_length, base,
                                         max_prompt_length=d.max_prompt_length, truncation_mode=d.truncation_mode)
    return build_vision_examples(rows, d.format, tok, spec, d.max_length, base,
                                 train_on_prompt=d.train_on_prompt, mask_history=d.mask_history, packing=d.packing)
