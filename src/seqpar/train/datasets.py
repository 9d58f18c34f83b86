"""Local datasets -> tokenized training examples (SFT rows, packed SFT rows, DPO pairs).

Files are read with `datasets` (JSONL / JSON / Parquet, or a directory of them). Each format maps to
token ids plus labels (-100 = not supervised): prompts are never supervised, responses (and every
assistant turn of a chat) are. Checks raise SeqParError naming the row and the fix; they run before
any process group exists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import SeqParError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "load_rows",
    "detect_format",
    "check_fields",
    "tokenize_sft",
    "tokenize_dpo",
    "build_examples",
    "pack_rows",
]

IGNORE = -100
FIELDS = {
    "text": [("text",)],
    "instruction": [("instruction", "prompt"), ("response", "completion", "output")],
    "chat": [("messages",)],
    "dpo": [("prompt",), ("chosen",), ("rejected",)],
    "tokenized": [("input_ids",)],
}


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

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        if tok.eos_token_id is None:
            raise SeqParError("the tokenizer has no eos token: set one (tokenizer.eos_token = ...)")
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
                "one (e.g. an -Instruct model), or set dataset.format: text"
            )
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.encode(text)


def load_rows(path: str) -> list[dict[str, Any]]:
    """All rows of a local JSONL / JSON / Parquet file or directory, via `datasets`."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise SeqParError(f"dataset.path={path!r} does not exist: point it at a local .jsonl/.json/.parquet file")
    files = sorted(str(f) for f in p.iterdir() if f.is_file()) if p.is_dir() else [str(p)]
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    exts = {os.path.splitext(f)[1] for f in files}
    unknown = exts - set(kinds)
    if unknown or not files:
        raise SeqParError(
            f"dataset.path={path!r}: unsupported file type(s) {sorted(unknown) or 'none'}: "
            "use .jsonl, .json or .parquet"
        )
    builders = {kinds[e] for e in exts}
    if len(builders) != 1:
        raise SeqParError(f"dataset.path={path!r} mixes JSON and Parquet files: keep one kind per directory")
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        raise SeqParError(f"dataset.path={path!r}: cannot read {unreadable[0]}: fix its permissions")
    try:
        ds = datasets.load_dataset(builders.pop(), data_files=files, split="train")
    except Exception as e:  # datasets wraps parser errors; the cause names the bad line
        cause = e.__cause__ or e
        raise SeqParError(f"dataset.path={path!r} could not be parsed ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0][:200] if str(cause) else ''}): fix the file") from None
    rows = ds.to_list()
    if not rows:
        raise SeqParError(f"dataset.path={path!r} has no rows: add some")
    return rows


def detect_format(columns: Sequence[str]) -> str:
    cols = set(columns)
    if {"prompt", "chosen", "rejected"} <= cols:
        return "dpo"
    if "messages" in cols:
        return "chat"
    if "input_ids" in cols:
        return "tokenized"
    if cols & {"instruction", "prompt"} and cols & {"response", "completion", "output"}:
        return "instruction"
    if "text" in cols:
        return "text"
    raise SeqParError(
        f"cannot tell the dataset format from its fields {sorted(cols)}: provide text, instruction/response, "
        "messages, prompt/chosen/rejected or input_ids, or set dataset.format"
    )


def _pick(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for n in names:
        if n in row and row[n] is not None:
            return row[n]
    return None


def check_fields(rows: list[dict[str, Any]], fmt: str, stage: str) -> None:
    if stage == "dpo" and fmt != "dpo":
        raise SeqParError(
            f"stage: dpo needs rows with prompt, chosen and rejected fields, but the data looks like format {fmt!r}: "
            "use a preference dataset, or set stage: sft"
        )
    if stage == "sft" and fmt == "dpo":
        raise SeqParError("stage: sft got preference rows (prompt/chosen/rejected): set stage: dpo")
    for i, row in enumerate(rows):
        for names in FIELDS[fmt]:
            if _pick(row, names) is None:
                what = " or ".join(repr(n) for n in names)
                raise SeqParError(
                    f"dataset row {i} has no {what} field (format {fmt!r} needs {FIELDS[fmt]}): add it to every row"
                    + (" (DPO rows need a rejected response)" if names == ("rejected",) else "")
                )
        if fmt == "chat":
            msgs = row["messages"]
            ok = isinstance(msgs, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs)
            if not ok:
                raise SeqParError(f"dataset row {i}: messages must be a list of {{role, content}} dicts")
            if not any(m["role"] == "assistant" for m in msgs):
                raise SeqParError(f"dataset row {i}: no assistant message to supervise: add one or drop the row")


def _chat_or_plain(tok: Tokenizer, prompt: str) -> list[int]:
    if isinstance(tok, ByteTokenizer) or getattr(tok, "has_chat_template", False):
        return tok.chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tok.encode(prompt)


def tokenize_sft(row: dict[str, Any], fmt: str, tok: Tokenizer) -> dict[str, list[int]]:
    """-> {"input_ids", "labels"} (untruncated)."""
    if fmt == "tokenized":
        ids = [int(x) for x in row["input_ids"]]
        labels = [int(x) for x in row["labels"]] if row.get("labels") is not None else list(ids)
        if len(labels) != len(ids):
            raise SeqParError(f"tokenized row has {len(ids)} input_ids but {len(labels)} labels: make them equal")
        return {"input_ids": ids, "labels": labels}
    if fmt == "text":
        ids = tok.encode(row["text"]) + [tok.eos_token_id]
        return {"input_ids": ids, "labels": list(ids)}
    if fmt == "instruction":
        prompt = _chat_or_plain(tok, _pick(row, FIELDS["instruction"][0]))
        resp = tok.encode(_pick(row, FIELDS["instruction"][1])) + [tok.eos_token_id]
        return {"input_ids": prompt + resp, "labels": [IGNORE] * len(prompt) + resp}
    if fmt == "chat":
        msgs = row["messages"]
        ids: list[int] = []
        labels: list[int] = []
        # Render growing prefixes: the tokens each assistant turn adds are supervised, the rest not.
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = tok.chat(msgs[:i], add_generation_prompt=True)
            upto = tok.chat(msgs[: i + 1], add_generation_prompt=False)
            if before[: len(ids)] != ids or upto[: len(before)] != before:
                raise SeqParError(
                    "the chat template does not render conversations prefix-consistently, so assistant turns "
                    "cannot be located: use format: instruction or a tokenized dataset"
                )
            labels += [IGNORE] * (len(before) - len(ids)) + upto[len(before):]
            ids = upto
        return {"input_ids": ids, "labels": labels}
    raise SeqParError(f"format {fmt!r} is not an SFT format")


def tokenize_dpo(row: dict[str, Any], tok: Tokenizer) -> dict[str, list[int]]:
    """-> {"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}; completions exclude the prompt."""
    return {
        "prompt_input_ids": _chat_or_plain(tok, row["prompt"]),
        "chosen_input_ids": tok.encode(row["chosen"]) + [tok.eos_token_id],
        "rejected_input_ids": tok.encode(row["rejected"]) + [tok.eos_token_id],
    }


def pack_rows(rows: list[dict[str, list[int]]], max_length: int) -> list[list[dict[str, list[int]]]]:
    """Greedy, order-preserving packing of rows into packs of at most max_length tokens."""
    packs: list[list[dict[str, list[int]]]] = []
    cur: list[dict[str, list[int]]] = []
    n = 0
    for r in rows:
        k = len(r["input_ids"])
        if cur and n + k > max_length:
            packs.append(cur)
            cur, n = [], 0
        cur.append(r)
        n += k
    if cur:
        packs.append(cur)
    return packs


def build_examples(rows: list[dict[str, Any]], fmt: str, stage: str, tok: Tokenizer, max_length: int,
                   packing: bool) -> tuple[list[Any], dict[str, int]]:
    """Tokenize, truncate to max_length, drop rows left without supervision, pack.

    Returns (examples, stats); an example is a row dict, or a list of row dicts (a pack).
    """
    if fmt == "auto":
        fmt = detect_format(list(rows[0].keys()))
    check_fields(rows, fmt, stage)
    stats = {"rows": len(rows), "truncated": 0, "dropped_unsupervised": 0}
    if stage == "dpo":
        out = []
        for i, row in enumerate(rows):
            ex = tokenize_dpo(row, tok)
            n_prompt = len(ex["prompt_input_ids"])
            if n_prompt >= max_length:
                raise SeqParError(
                    f"DPO row {i}: the prompt alone has {n_prompt} tokens >= dataset.max_length={max_length}, leaving "
                    f"no response tokens: raise max_length above {n_prompt} or shorten the prompt"
                )
            # The collator cuts prompt + completion to max_length on the right.
            stats["truncated"] += sum(n_prompt + len(ex[k]) > max_length
                                      for k in ("chosen_input_ids", "rejected_input_ids"))
            out.append(ex)
        return out, stats
    examples = []
    longest_prompt = 0
    for row in rows:
        ex = tokenize_sft(row, fmt, tok)
        if len(ex["input_ids"]) > max_length:
            ex = {k: v[:max_length] for k, v in ex.items()}
            stats["truncated"] += 1
        # A target exists where labels[t+1] != -100 (the collator shifts on the full sequence).
        if not any(lab != IGNORE for lab in ex["labels"][1:]):
            stats["dropped_unsupervised"] += 1
            first = next((j for j, lab in enumerate(tokenize_sft(row, fmt, tok)["labels"]) if lab != IGNORE), None)
            longest_prompt = max(longest_prompt, first or 0)
            continue
        examples.append(ex)
    if not examples:
        raise SeqParError(
            f"no row keeps a supervised token within dataset.max_length={max_length} (responses start at token "
            f"{longest_prompt} or later): raise max_length above {longest_prompt}"
        )
    if packing:
        return pack_rows(examples, max_length), stats
    return examples, stats
