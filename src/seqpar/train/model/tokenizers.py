"""Tokenizers as the dataset code uses them: `encode(text)` and `chat(messages, add_generation_prompt)`.

ByteTokenizer (tiny test models: one id per UTF-8 byte, a fixed chat markup) and HFTokenizer (a
transformers tokenizer, optionally with the run's own chat template, dataset.chat_template).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ...errors import SeqParError
from ...textfiles import read_text

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_chat_template"]


class Tokenizer(Protocol):
    eos_token_id: int
    pad_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) + bos/eos/pad; for tiny random test models.

    Chat turns render as "<role>\\n" + content + eos, so prefix rendering is exact.
    """

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        ids: list[int] = [self.bos_token_id]
        for m in messages:
            ids += self.encode(f"<{m['role']}>\n") + self.encode(m["content"]) + [self.eos_token_id]
        if add_generation_prompt:
            ids += self.encode("<assistant>\n")
        return ids


class HFTokenizer:
    """Adapter over a transformers tokenizer (chat template rendered to text, then encoded)."""

    def __init__(self, tok: Any, chat_template: str | None = None) -> None:
        self.tok = tok
        if tok.eos_token_id is None:
            raise SeqParError("the tokenizer has no eos token: set one (tokenizer.eos_token = ...)")
        if chat_template is not None:
            tok.chat_template = chat_template  # dataset.chat_template overrides the model's own
        self.eos_token_id = int(tok.eos_token_id)
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.has_chat_template = bool(getattr(tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        if not self.has_chat_template:
            raise SeqParError(
                "this tokenizer has no chat template, needed for chat/instruction/dpo data: use a model with "
                "one (e.g. an -Instruct model), set dataset.chat_template, or set dataset.format: text"
            )
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text)


def load_chat_template(value: str) -> str:
    """dataset.chat_template: a Jinja template itself, or the path of a file holding one (.jinja)."""
    if "{{" in value or "{%" in value:
        return value
    p = Path(value)
    if not p.is_file():
        raise SeqParError(
            f"dataset.chat_template={value!r} is neither a Jinja template (no '{{{{' or '{{%') nor an existing file: "
            "give the template text or the path of a .jinja file"
        )
    return read_text(p, "dataset.chat_template file")
