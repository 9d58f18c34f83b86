"""Reading the text files a user hands seqpar (configs, datasets, templates, a run's JSON records): a file that is
not UTF-8 (a binary file, another encoding) or not valid JSON is a SeqParError naming the file, the place and the
fix, never a UnicodeDecodeError traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import SeqParError

__all__ = ["read_text", "read_json"]


def read_text(path: str | Path, what: str) -> str:
    """The file's text as UTF-8 (a leading BOM dropped). `what` names the file's role for the message, e.g.
    "dataset.path" or "config file"."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SeqParError(f"{what} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, line "
                          f"{line}): is it the right file? Give a UTF-8 text file (re-save it as UTF-8)") from None


def read_json(path: str | Path, what: str) -> Any:
    """The file's JSON value; SeqParError for text that is not UTF-8 or not JSON (line and column named)."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SeqParError(f"{what} {path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}): fix or replace the "
                          f"file") from None
