"""`stage: grpo` datasets: prompt rows (text or chat messages) tokenized for generation, every other
column kept for the reward functions; over-long prompts keep their end (counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import SeqParError
from ..config import TrainConfig
from ..model.tokenizers import ByteTokenizer
from .formats import normalize_messages
from .tokenize import load_rows

__all__ = ["PromptRow", "load_prompts", "describe_prompt_stats"]


@dataclass
class PromptRow:
    prompt: Any  # the dataset's value: text, or a list of chat messages
    prompt_ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)  # every other column, for the reward functions

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


def load_prompts(cfg: TrainConfig, tok: Any) -> tuple[list[PromptRow], dict[str, int]]:
    """Prompt rows of cfg.dataset; prompts over grpo.max_prompt_length keep their END (truncated left,
    as TRL), counted in stats["prompt_truncated"]. Empty prompts are refused."""
    rows = load_rows(cfg.dataset.path)
    keep = cfg.grpo.max_prompt_length
    out, cut = [], 0
    for i, row in enumerate(rows, 1):  # 1-based: the line of a JSONL file
        if "prompt" not in row:
            raise SeqParError(f"{cfg.dataset.path}: row {i} has no 'prompt' column: stage: grpo reads prompt rows "
                              f"(text or chat messages, plus any columns the reward functions read)")
        if any(row.get(k) for k in ("images", "image", "videos", "video")):
            raise SeqParError(f"{cfg.dataset.path}: row {i} carries images/videos, but stage: grpo generates from "
                              "text prompts only (the images would be ignored): drop the image columns, or train "
                              "on them with stage: sft / dpo")
        ids = _tokenize_prompt(row["prompt"], tok, i)
        if not ids:
            raise SeqParError(f"row {i}: the prompt is empty: remove the row")
        if len(ids) > keep:
            ids, cut = ids[-keep:], cut + 1
        out.append(PromptRow(row["prompt"], ids, {k: v for k, v in row.items() if k != "prompt"}))
    # truncated / dropped_unsupervised: the SFT/DPO keys `seqpar check` prints (nothing is cut or dropped here)
    return out, {"rows": len(out), "prompt_truncated": cut, "truncated": 0, "dropped_unsupervised": 0}


def describe_prompt_stats(stats: dict[str, int], max_prompt_length: int) -> list[str]:
    if not stats.get("prompt_truncated"):
        return []
    return [f"dataset: {stats['prompt_truncated']} of {stats['rows']} prompts cut to their last "
            f"grpo.max_prompt_length={max_prompt_length} tokens"]
