"""Local datasets -> tokenized training examples (SFT rows, packed SFT rows, DPO pairs).

Files are read with `datasets` (JSONL / JSON / Parquet, or a directory of them); dataset/formats.py
maps each row format to text, token ids or a conversation, and this module tokenizes them into ids
plus labels (-100 = not supervised): prompts are not supervised, responses (and every assistant turn
of a chat) are, unless train_on_prompt / mask_history say otherwise. What is truncated or dropped is
counted in the stats build_examples returns. Checks raise SeqParError naming the row and the fix;
they run before any process group exists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import SeqParError
from ...textfiles import read_text
from ..model.tokenizers import ByteTokenizer, Tokenizer
from .formats import Text, Tokenized, check_stage, detect_format, normalize_dpo, normalize_sft

__all__ = ["IGNORE", "load_rows", "detect_format", "tokenize_sft", "tokenize_dpo", "build_examples", "pack_rows",
           "describe_stats", "build_dpo_pairs", "new_stats"]

IGNORE = -100


def load_rows(path: str, what: str = "dataset") -> list[dict[str, Any]]:
    """All rows of a local JSONL / JSON / Parquet file or directory (`what`: the config key, for messages).

    JSON is parsed as written (strings stay strings: no column type inference across rows); Parquet is
    read with `datasets`. Errors name the file and the 1-based line."""
    p = Path(path)
    if not p.exists():
        raise SeqParError(f"{what}.path={path!r} does not exist: point it at a local .jsonl/.json/.parquet file")
    files = sorted(str(f) for f in p.iterdir() if f.is_file()) if p.is_dir() else [str(p)]
    kinds = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    exts = {os.path.splitext(f)[1] for f in files}
    unknown = exts - set(kinds)
    if unknown or not files:
        raise SeqParError(
            f"{what}.path={path!r}: unsupported file type(s) {sorted(unknown) or 'none'}: "
            "use .jsonl, .json or .parquet"
        )
    builders = {kinds[e] for e in exts}
    if len(builders) != 1:
        raise SeqParError(f"{what}.path={path!r} mixes JSON and Parquet files: keep one kind per directory")
    unreadable = [f for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        raise SeqParError(f"{what}.path={path!r}: cannot read {unreadable[0]}: fix its permissions")
    rows = [r for f in files for r in (_json_rows(f, what) if builders == {"json"} else _parquet_rows(f, what))]
    if not rows:
        raise SeqParError(f"{what}.path={path!r} is empty: add rows (one JSON object per line)")
    return rows


def _json_rows(path: str, what: str) -> list[dict[str, Any]]:
    """A JSON array of objects, or JSON lines (one object per line; blank lines skipped)."""
    text = read_text(path, f"{what}:")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise SeqParError(f"{what}: {path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}): fix the file") from None
        numbered = list(enumerate(rows, 1))
    else:
        numbered = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise SeqParError(f"{what}: {path}:{n}: invalid JSON ({e.msg} at column {e.colno}): fix the "
                                  "line") from None
    for n, row in numbered:
        if not isinstance(row, dict):
            raise SeqParError(f"{what}: {path}: row {n} is a {type(row).__name__}, not an object of fields: "
                              "write one JSON object per row")
    return [row for _, row in numbered]


def _parquet_rows(path: str, what: str) -> list[dict[str, Any]]:
    import datasets

    try:
        return datasets.load_dataset("parquet", data_files=[path], split="train").to_list()
    except Exception as e:  # datasets wraps reader errors
        cause = e.__cause__ or e
        raise SeqParError(f"{what}: {path} could not be read ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0][:200] if str(cause) else ''}): fix the file") from None


def _chat_or_plain(tok: Tokenizer, prompt: str) -> list[int]:
    if isinstance(tok, ByteTokenizer) or getattr(tok, "has_chat_template", False):
        return tok.chat([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tok.encode(prompt)


def tokenize_sft(row: dict[str, Any], fmt: str, tok: Tokenizer, *, train_on_prompt: bool = False,
                 mask_history: bool = False, index: int = 0) -> dict[str, list[int]]:
    """-> {"input_ids", "labels"} (untruncated).

    train_on_prompt: supervise every token (prompt and template tokens too); mask_history: supervise
    only the last assistant turn of a conversation.
    """
    ex = normalize_sft(row, fmt, index)
    if isinstance(ex, Tokenized):
        return {"input_ids": ex.input_ids, "labels": ex.labels if ex.labels is not None else list(ex.input_ids)}
    if isinstance(ex, Text):
        ids = tok.encode(ex.text) + [tok.eos_token_id]
        return {"input_ids": ids, "labels": list(ids)}
    train = list(ex.train)
    if mask_history:
        last = max(j for j, t in enumerate(train) if t)
        train = [j == last for j in range(len(train))]
    out = _render_conversation(ex.messages, train, tok)
    if train_on_prompt:
        out["labels"] = list(out["input_ids"])
    return out


def _can_chat(tok: Tokenizer) -> bool:
    return isinstance(tok, ByteTokenizer) or getattr(tok, "has_chat_template", False)


def _render_conversation(msgs: list[dict[str, Any]], train: list[bool], tok: Tokenizer) -> dict[str, list[int]]:
    if not _can_chat(tok):
        # No chat template: a single user -> assistant exchange is plain prompt + response + eos.
        if [m["role"] for m in msgs] != ["user", "assistant"]:
            raise SeqParError(
                "this tokenizer has no chat template, needed for system prompts, history and multi-turn chats: "
                "use a model with one, or set dataset.chat_template"
            )
        prompt, resp = tok.encode(msgs[0]["content"]), tok.encode(msgs[1]["content"]) + [tok.eos_token_id]
        return {"input_ids": prompt + resp, "labels": [IGNORE] * len(prompt) + resp}
    ids: list[int] = []
    labels: list[int] = []
    # Render growing prefixes: the tokens each assistant turn adds are supervised (when trained), the rest not.
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tok.chat(msgs[:i], add_generation_prompt=True)
        upto = tok.chat(msgs[: i + 1], add_generation_prompt=False)
        if before[: len(ids)] != ids or upto[: len(before)] != before:
            raise SeqParError(
                "the chat template does not render conversations prefix-consistently, so assistant turns "
                "cannot be located: set dataset.chat_template to one that does, or use a tokenized dataset"
            )
        turn = upto[len(before):]
        labels += [IGNORE] * (len(before) - len(ids)) + (turn if train[i] else [IGNORE] * len(turn))
        ids = upto
    return {"input_ids": ids, "labels": labels}


def _completion(tok: Tokenizer, prompt: Any, completion: Any, prompt_ids: list[int]) -> list[int]:
    if isinstance(completion, str):
        return tok.encode(completion) + [tok.eos_token_id]
    full = tok.chat(prompt + completion, add_generation_prompt=False)
    if full[: len(prompt_ids)] != prompt_ids:
        raise SeqParError(
            "the chat template does not render the prompt as a prefix of prompt + completion, so the completion "
            "cannot be located: set dataset.chat_template to one that does, or use string prompts"
        )
    return full[len(prompt_ids):]


def tokenize_dpo(row: dict[str, Any], tok: Tokenizer, index: int = 0) -> dict[str, list[int]]:
    """-> {"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}; completions exclude the prompt."""
    p = normalize_dpo(row, index)
    if isinstance(p.prompt, str):
        prompt_ids = _chat_or_plain(tok, p.prompt)
    else:
        if not _can_chat(tok):
            raise SeqParError(
                "conversational DPO rows need a tokenizer with a chat template: set dataset.chat_template"
            )
        prompt_ids = tok.chat(p.prompt, add_generation_prompt=True)
    out = {"prompt_input_ids": prompt_ids,
           "chosen_input_ids": _completion(tok, p.prompt, p.chosen, prompt_ids),
           "rejected_input_ids": _completion(tok, p.prompt, p.rejected, prompt_ids)}
    for k in ("ref_chosen_logps", "ref_rejected_logps"):
        if row.get(k) is not None:
            out[k] = row[k]
    return out


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


def new_stats(n_rows: int) -> dict[str, int]:
    """A dataset's counters before any row is read (what build_examples returns; describe_stats prints them)."""
    return {"rows": n_rows, "truncated": 0, "dropped_unsupervised": 0, "prompt_truncated": 0,
            "dropped_long_prompt": 0, "identical_pairs": 0}


def _truncate_prompt(ids: list[int], keep: int, mode: str) -> list[int]:
    return ids[-keep:] if mode == "keep_end" else ids[:keep]


def build_dpo_pairs(rows: list[dict[str, Any]], tok: Tokenizer, max_length: int, max_prompt_length: int | None,
                    truncation_mode: str, stats: dict[str, int],
                    encode: Callable[[dict[str, Any], int], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Pairs; prompts cut to max_prompt_length (when set), pairs whose prompt still reaches max_length skipped.
    encode(row, i): the tokenized pair (default tokenize_dpo; vision-language pairs add their prompt's media)."""
    out, longest = [], 0
    for i, row in enumerate(rows, 1):  # 1-based: the line of a JSONL file
        ex = encode(row, i) if encode is not None else tokenize_dpo(row, tok, i)
        n_prompt = len(ex["prompt_input_ids"])
        if max_prompt_length is not None and n_prompt > max_prompt_length:
            if "ref_chosen_logps" in ex:
                raise SeqParError(
                    f"DPO row {i}: its prompt ({n_prompt} tokens) would be cut to "
                    f"max_prompt_length={max_prompt_length}, "
                    f"but its precomputed reference log-probs were taken on the full prompt: raise max_prompt_length "
                    f"or recompute them"
                )
            ex["prompt_input_ids"] = _truncate_prompt(ex["prompt_input_ids"], max_prompt_length, truncation_mode)
            stats["prompt_truncated"] += 1
            n_prompt = max_prompt_length
        if n_prompt >= max_length:  # no completion token would be left: like a row with nothing to supervise
            stats["dropped_long_prompt"] += 1
            longest = max(longest, n_prompt)
            continue
        # The collator cuts prompt + completion to max_length on the right.
        stats["truncated"] += sum(n_prompt + len(ex[k]) > max_length
                                  for k in ("chosen_input_ids", "rejected_input_ids"))
        keep = max_length - n_prompt  # identical within what trains: no preference to learn (loss stays ln 2)
        stats["identical_pairs"] += ex["chosen_input_ids"][:keep] == ex["rejected_input_ids"][:keep]
        out.append(ex)
    if not out:
        raise SeqParError(
            f"every DPO row's prompt alone reaches dataset.max_length={max_length} (up to {longest} tokens), leaving "
            f"no response tokens: raise dataset.max_length above {longest}, or set dataset.max_prompt_length below "
            f"{max_length} to cut prompts (dataset.truncation_mode: keep_end | keep_start)"
        )
    return out


def build_examples(rows: list[dict[str, Any]], fmt: str, stage: str, tok: Tokenizer, max_length: int,
                   packing: bool, *, train_on_prompt: bool = False, mask_history: bool = False,
                   max_prompt_length: int | None = None,
                   truncation_mode: str = "keep_end") -> tuple[list[Any], dict[str, int]]:
    """Tokenize, truncate to max_length, drop rows left without supervision, pack.

    Returns (examples, stats); an example is a row dict, or a list of row dicts (a pack). stats counts
    what was changed: rows, truncated (SFT rows cut to max_length; DPO completions the collator will
    cut), dropped_unsupervised (SFT rows with no supervised token left), prompt_truncated (DPO prompts
    cut to max_prompt_length), dropped_long_prompt (DPO pairs whose prompt alone reaches max_length).
    """
    if fmt == "auto":
        fmt = detect_format(list(rows[0].keys()))
    check_stage(fmt, stage)
    stats = new_stats(len(rows))
    if stage == "dpo":
        return build_dpo_pairs(rows, tok, max_length, max_prompt_length, truncation_mode, stats), stats
    examples = []
    longest_prompt = 0
    no_labels = 0  # rows whose labels are all -100 (no max_length helps them)
    for i, row in enumerate(rows, 1):  # 1-based: the line of a JSONL file
        full = tokenize_sft(row, fmt, tok, train_on_prompt=train_on_prompt, mask_history=mask_history, index=i)
        cut = len(full["input_ids"]) > max_length
        ex = {k: v[:max_length] for k, v in full.items()} if cut else full
        # A target exists where labels[t+1] != -100 (the collator shifts on the full sequence).
        if not any(lab != IGNORE for lab in ex["labels"][1:]):
            stats["dropped_unsupervised"] += 1
            first = next((j for j, lab in enumerate(full["labels"]) if lab != IGNORE and j > 0), None)
            no_labels += first is None
            longest_prompt = max(longest_prompt, first or 0)
            continue
        stats["truncated"] += cut  # counted for kept rows only (a dropped row is counted once, as dropped)
        examples.append(ex)
    if not examples and no_labels == len(rows):
        raise SeqParError("every row's labels are -100 (not supervised) after the first token, so there is nothing "
                          f"to train on: {_no_labels_fix(fmt, train_on_prompt)}")
    if not examples:
        raise SeqParError(
            f"no row keeps a supervised token within dataset.max_length={max_length} (responses start at token "
            f"{longest_prompt} or later): raise dataset.max_length above {longest_prompt}"
        )
    if packing:
        return pack_rows(examples, max_length), stats
    return examples, stats


def _no_labels_fix(fmt: str, train_on_prompt: bool) -> str:
    """What to change when no row has a supervised token (by format: train_on_prompt cannot help tokenized rows)."""
    if fmt == "tokenized":
        return ("tokenized rows keep their labels as given (dataset.train_on_prompt does not change them): give labels "
                "other than -100 after the first token, or leave the labels column out to supervise every token")
    if train_on_prompt:
        return ("dataset.train_on_prompt is already on (every token after the first is supervised), so every row is "
                "at most one token long: check the rows' text")
    return "check the rows, or set dataset.train_on_prompt: true to supervise the prompts"


def describe_stats(stats: dict[str, int], max_length: int, what: str = "dataset") -> list[str]:
    """Human-readable lines for what build_examples changed (empty when nothing was)."""
    msgs = {
        "truncated": f"truncated to max_length={max_length}",
        "dropped_unsupervised": f"dropped (no supervised token within max_length={max_length})",
        "prompt_truncated": "with the DPO prompt cut to max_prompt_length",
        "dropped_long_prompt": f"dropped (the DPO prompt alone reaches max_length={max_length})",
        "identical_pairs": "with chosen == rejected within max_length (no preference to learn: their loss stays "
                           "at ln 2)",
    }
    return [f"{what}: {stats[k]} of {stats['rows']} rows {m}" for k, m in msgs.items() if stats.get(k)]
