"""Dataset rows in the formats people have -> one canonical form (no tokenization here).

SFT rows become one of
- `Text(text)`                      plain language modelling (every token supervised);
- `Tokenized(input_ids, labels)`    as given;
- `Conversation(messages, train)`   role/content messages + which messages are supervised (assistant
                                    turns; `train[i]` False for prompt-side assistant turns).
DPO rows become `Preference(prompt, chosen, rejected)`, each a string or a list of messages.

Formats (field names as LLaMA-Factory and TRL write them):
- text:        {"text"}
- instruction: Alpaca {"instruction", "input"?, "output"|"response", "system"?, "history"?: [[q, a], ...]}
               ("input" joins the instruction after a blank line, as LLaMA-Factory does), and TRL
               prompt-completion {"prompt", "completion"} where each is a string or a list of messages
               (only the completion is supervised);
- chat:        TRL conversational {"messages": [{"role", "content"}]};
- sharegpt:    {"conversations": [{"from", "value"}], "system"?} (roles human/gpt/system/function_call/
               observation/...), and LLaMA-Factory's ShareGPT preference rows (+ "chosen"/"rejected" messages);
- dpo:         {"prompt", "chosen", "rejected"}: strings, or lists of messages (TRL conversational), or
               no prompt and full conversations in chosen/rejected (TRL implicit prompt: the shared prefix);
- tokenized:   {"input_ids", "labels"?}.
Message content may be null (rendered as "") or a list of {"type": "text", "text"} parts.
Every problem raises SeqParError naming the row and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import SeqParError

__all__ = ["Text", "Tokenized", "Conversation", "Preference", "FORMATS", "detect_format", "check_stage",
           "normalize_sft", "normalize_dpo", "normalize_messages"]

FORMATS = ("text", "instruction", "chat", "sharegpt", "dpo", "tokenized")

# ShareGPT / LLaMA-Factory role names -> chat-template roles. function_call is the assistant's tool call
# (supervised); observation is the tool's answer (context only).
ROLES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "bot": "assistant", "chatgpt": "assistant",
    "function_call": "assistant",
    "observation": "tool", "tool": "tool", "function": "tool", "ipython": "tool",
}
INSTRUCTION = ("instruction", "prompt")
RESPONSE = ("output", "response", "completion")


@dataclass
class Text:
    text: str


@dataclass
class Tokenized:
    input_ids: list[int]
    labels: list[int] | None


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    train: list[bool] = field(default_factory=list)  # per message: supervise it (assistant turns only)


@dataclass
class Preference:
    prompt: str | list[dict[str, Any]]
    chosen: str | list[dict[str, Any]]
    rejected: str | list[dict[str, Any]]


def detect_format(columns: Sequence[str]) -> str:
    cols = set(columns)
    if {"chosen", "rejected"} <= cols:
        return "dpo"
    if "conversations" in cols:
        return "sharegpt"
    if "messages" in cols:
        return "chat"
    if "input_ids" in cols:
        return "tokenized"
    if cols & set(INSTRUCTION) and cols & set(RESPONSE):
        return "instruction"
    if "text" in cols:
        return "text"
    raise SeqParError(
        f"cannot tell the dataset format from its fields {sorted(cols)}: provide text, instruction/output, "
        "prompt/completion, messages, conversations, prompt/chosen/rejected or input_ids, or set dataset.format"
    )


def check_stage(fmt: str, stage: str) -> None:
    if stage == "dpo" and fmt != "dpo":
        raise SeqParError(
            f"stage: dpo needs rows with prompt, chosen and rejected fields, but the data looks like format {fmt!r}: "
            "use a preference dataset, or set stage: sft"
        )
    if stage == "sft" and fmt == "dpo":
        raise SeqParError("stage: sft got preference rows (prompt/chosen/rejected): set stage: dpo")


def _pick(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for n in names:
        if row.get(n) is not None:
            return row[n]
    return None


def _need(row: dict[str, Any], names: tuple[str, ...], i: int, fmt: str, hint: str = "") -> Any:
    v = _pick(row, names)
    if v is None:
        what = " or ".join(repr(n) for n in names)
        raise SeqParError(f"row {i} has no {what} field (format {fmt!r}): add it to every row{hint}")
    return v


def _content(v: Any, i: int) -> str:
    if v is None:
        return ""  # TRL writes content: null for tool-call turns
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in v):
        return "".join(p.get("text") or "" for p in v)
    raise SeqParError(f"row {i}: message content must be a string, null or a list of text parts, got {v!r:.80}")


def _int_list(v: Any, i: int, key: str) -> list[int]:
    """A tokenized row's input_ids (token ids >= 0) or labels (the same, or -100: not supervised)."""
    def ok(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and (x >= 0 or (key == "labels" and x == -100))

    if not isinstance(v, list) or not all(ok(x) for x in v):
        bad = v if not isinstance(v, list) else next(x for x in v if not ok(x))
        what = "token ids >= 0 or -100 (not supervised)" if key == "labels" else "token ids >= 0"
        raise SeqParError(f"row {i}: {key} must be a list of integers, {what}; got {bad!r:.60}")
    return v


def normalize_messages(msgs: Any, i: int) -> list[dict[str, Any]]:
    """{role|from, content|value} dicts -> {role, content} dicts (other keys, e.g. tool_calls, kept)."""
    if isinstance(msgs, dict):
        msgs = [msgs]
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise SeqParError(f"row {i}: messages must be a list of {{role, content}} dicts")
    out = []
    for m in msgs:
        role = m.get("role", m.get("from"))
        if role not in ROLES:
            raise SeqParError(
                f"row {i}: unknown message role {role!r}: use one of {sorted(ROLES)} (in 'role' or 'from')"
            )
        if "content" not in m and "value" not in m:
            raise SeqParError(f"row {i}: a message has no 'content' (or 'value') field: add it")
        extra = {k: v for k, v in m.items() if k not in ("role", "from", "content", "value") and v is not None}
        out.append({**extra, "role": ROLES[role], "content": _content(m.get("content", m.get("value")), i)})
    return out


def _conversation(messages: list[dict[str, Any]], i: int, n_prompt: int = 0) -> Conversation:
    """Supervise the assistant turns from message n_prompt on (earlier ones are prompt context)."""
    train = [m["role"] == "assistant" and j >= n_prompt for j, m in enumerate(messages)]
    if not any(train):
        raise SeqParError(f"row {i}: no assistant message to supervise: add one or drop the row")
    return Conversation(messages, train)


def _alpaca(row: dict[str, Any], i: int) -> Conversation:
    prompt = _need(row, INSTRUCTION, i, "instruction")
    resp = _need(row, RESPONSE, i, "instruction")
    if isinstance(prompt, list) or isinstance(resp, list):  # TRL conversational prompt-completion
        p = normalize_messages(prompt, i) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        c = normalize_messages(resp, i) if isinstance(resp, list) else [{"role": "assistant", "content": resp}]
        return _conversation(p + c, i, n_prompt=len(p))
    if row.get("input"):
        prompt = f"{prompt}\n\n{row['input']}"
    msgs: list[dict[str, Any]] = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    for turn in row.get("history") or []:
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise SeqParError(f"row {i}: history must be a list of [instruction, response] pairs")
        msgs += [{"role": "user", "content": _content(turn[0], i)},
                 {"role": "assistant", "content": _content(turn[1], i)}]
    msgs += [{"role": "user", "content": _content(prompt, i)}, {"role": "assistant", "content": _content(resp, i)}]
    return _conversation(msgs, i)


def normalize_sft(row: dict[str, Any], fmt: str, i: int) -> Text | Tokenized | Conversation:
    if fmt == "text":
        return Text(_content(_need(row, ("text",), i, fmt), i))
    if fmt == "tokenized":
        ids = _int_list(_need(row, ("input_ids",), i, fmt), i, "input_ids")
        labels = _int_list(row["labels"], i, "labels") if row.get("labels") is not None else None
        if labels is not None and len(labels) != len(ids):
            raise SeqParError(f"tokenized row has {len(ids)} input_ids but {len(labels)} labels: make them equal")
        return Tokenized(ids, labels)
    if fmt == "instruction":
        return _alpaca(row, i)
    if fmt == "chat":
        return _conversation(normalize_messages(_need(row, ("messages",), i, fmt), i), i)
    if fmt == "sharegpt":
        msgs = normalize_messages(_need(row, ("conversations",), i, fmt), i)
        if row.get("system") and not (msgs and msgs[0]["role"] == "system"):
            msgs = [{"role": "system", "content": row["system"]}] + msgs
        return _conversation(msgs, i)
    raise SeqParError(f"format {fmt!r} is not an SFT format: use one of {[f for f in FORMATS if f != 'dpo']}")


def _shared_prefix(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def normalize_dpo(row: dict[str, Any], i: int) -> Preference:
    hint = " (DPO rows need a rejected response)"
    chosen = _need(row, ("chosen",), i, "dpo", hint if "chosen" in row else "")
    rejected = _need(row, ("rejected",), i, "dpo", hint)
    prompt = _pick(row, ("prompt", "conversations"))
    for key, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if v is not None and not isinstance(v, (str, list, dict)):
            raise SeqParError(f"row {i}: '{key}' must be text or a list of chat messages, got {type(v).__name__}")
    conversational = any(isinstance(x, (list, dict)) for x in (prompt, chosen, rejected))
    if not conversational:
        if prompt is None:
            raise SeqParError(f"row {i} has no 'prompt' field (format 'dpo'): add it to every row")
        return Preference(prompt, chosen, rejected)
    as_msgs = {"chosen": chosen, "rejected": rejected}
    for k, role in (("chosen", "assistant"), ("rejected", "assistant")):
        v = as_msgs[k]
        as_msgs[k] = normalize_messages(v, i) if isinstance(v, (list, dict)) else [{"role": role, "content": v}]
    c, r = as_msgs["chosen"], as_msgs["rejected"]
    if prompt is None:  # TRL implicit prompt: chosen/rejected are whole conversations sharing the prompt
        n = _shared_prefix(c, r)
        if n == 0:
            raise SeqParError(
                f"row {i}: no 'prompt' and chosen/rejected share no leading messages: add a prompt"
            )
        return Preference(c[:n], c[n:], r[n:])
    p = normalize_messages(prompt, i) if isinstance(prompt, (list, dict)) else [{"role": "user", "content": prompt}]
    return Preference(p, c, r)
