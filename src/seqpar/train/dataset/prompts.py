"""`stage: grpo` datasets: prompt rows (text or chat messages) tokenized for generation, every other
column kept for the reward functions; over-long prompts keep their end (counted). For a vision-language model a
prompt may carry `images` / `videos` (one `<image>` / `<video>` placeholder each, as in SFT rows:
train/dataset/images.py): they are expanded and kept with the row (`PromptRow.media`), so rollouts see them and
the policy's loss runs on the full multimodal sequence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...errors import SeqParError
from ..config import TrainConfig
from ..model.load import ModelInfo
from ..model.tokenizers import ByteTokenizer
from .formats import normalize_messages
from .images import TEXT_ONLY, VisionSpec, carries_media, expand_media, with_markers
from .tokenize import load_rows

__all__ = ["PromptRow", "load_prompts", "describe_prompt_stats"]


@dataclass
class PromptRow:
    prompt: Any  # the dataset's value: text, or a list of chat messages
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)  # every other column, for the reward functions
    media: dict[str, Any] = field(default_factory=dict)  # a VL prompt's pixel_values / grids (VisionCollator keys)

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def _tokenize_prompt(prompt: Any, tok: Any, i: int) -> list[int]:
    if isinstance(prompt, str):
        return tok.encode(prompt)  # plain text: no chat template (TRL's "standard" prompts)
    if isinstance(prompt, list):
        if not (isinstance(tok, ByteTokenizer) or getattr(tok, "has_chat_template", False)):
            raise SeqParError(f"row {i}: a chat-message prompt needs a chat template: set dataset.chat_template")
        return tok.chat(normalize_messages(prompt, i), add_generation_prompt=True)
    raise SeqParError(f"row {i}: 'prompt' must be text or a list of chat messages, got {type(prompt).__name__}")


def _media_prompt(row: dict, i: int, tok: Any, spec: VisionSpec | None, base_dir: str) -> tuple[list[int], dict]:
    """A prompt with images / videos: (ids with the media's tokens, the media tensors)."""
    if spec is None:
        raise SeqParError(f"row {i} {TEXT_ONLY}")
    ids = _tokenize_prompt(with_markers({"prompt": row["prompt"]}, tok)["prompt"], tok, i)
    out = expand_media(ids, None, row, tok, spec, base_dir, i)
    return out.pop("input_ids"), out


def load_prompts(cfg: TrainConfig, tok: Any, info: ModelInfo | None = None) -> tuple[list[PromptRow], dict[str, int]]:
    """Prompt rows of cfg.dataset; prompts over grpo.max_prompt_length keep their END (truncated left,
    as TRL), counted in stats["prompt_truncated"] (a cut inside an image or video is refused). Empty prompts
    are refused. info: the run's model config (images / videos need a vision-language model)."""
    rows = load_rows(cfg.dataset.path)
    keep = cfg.grpo.max_prompt_length
    spec = VisionSpec.from_model_config(info.config, cfg.model.name) if info is not None and info.vlm else None
    base_dir = os.path.dirname(os.path.abspath(cfg.dataset.path))
    out, cut = [], 0
    for i, row in enumerate(rows, 1):  # 1-based: the line of a JSONL file
        if "prompt" not in row:
            raise SeqParError(f"{cfg.dataset.path}: row {i} has no 'prompt' column: stage: grpo reads prompt rows "
                              f"(text or chat messages, plus any columns the reward functions read)")
        media: dict = {}
        if carries_media(row, i):
            if row.get("image") or row.get("video"):
                raise SeqParError(f"{cfg.dataset.path}: row {i}: name the media columns 'images' / 'videos' (lists "
                                  "of local files, one <image> / <video> placeholder each)")
            try:
                ids, media = _media_prompt(row, i, tok, spec, base_dir)
            except SeqParError as e:
                raise SeqParError(f"{cfg.dataset.path}: {e}") from None
        else:
            ids = _tokenize_prompt(row["prompt"], tok, i)
        if not ids:
            raise SeqParError(f"row {i}: the prompt is empty: remove the row")
        if len(ids) > keep:
            if media and spec is not None and spec.vision_start_id in ids[:-keep]:
                raise SeqParError(f"{cfg.dataset.path}: row {i}: grpo.max_prompt_length={keep} would cut its images / "
                                  f"videos (the prompt has {len(ids)} tokens): raise max_prompt_length")
            ids, cut = ids[-keep:], cut + 1
        out.append(PromptRow(row["prompt"], ids, {k: v for k, v in row.items() if k not in ("prompt", "images",
                                                                                             "videos")}, media))
    # truncated / dropped_unsupervised: the SFT/DPO keys `seqpar check` prints (nothing is cut or dropped here)
    return out, {"rows": len(out), "prompt_truncated": cut, "truncated": 0, "dropped_unsupervised": 0}


def describe_prompt_stats(stats: dict[str, int], max_prompt_length: int) -> list[str]:
    if not stats.get("prompt_truncated"):
        return []
    return [f"dataset: {stats['prompt_truncated']} of {stats['rows']} prompts cut to their last "
            f"grpo.max_prompt_length={max_prompt_length} tokens"]
