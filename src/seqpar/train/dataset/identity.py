"""What a run's data is, for a resume to find again: the dataset's resolved path, a hash of its file bytes, and a
fingerprint of the examples as trained (token ids, labels, packing, media tensors, the reward functions' columns).

A checkpoint's data position is a row count into the run's global row order, so it means the same rows only
over the same examples. The examples' fingerprint decides (it also sees a tokenizer, chat template or tokenization
setting that changed); the file hash and path only say *which* changed. Moving the data elsewhere with the same
content keeps the identity.

The file hash reads every byte of a dataset that may be many GB, so it is read once: the launcher's checks hash it
and hand the result to the ranks in SEQPAR_DATA_SHA256 (with the files' paths, sizes and mtimes: a file changed
since is hashed again), and within a process (ranks that are threads) it is kept. Ranks started without
`seqpar train`'s launcher (torchrun directly) hash it once each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["DataIdentity", "data_identity", "resolved_path", "fingerprint", "dataset_files", "file_hash",
           "export_file_hash", "DATA_HASH_ENV"]

_CHUNK = 1 << 20
DATA_HASH_ENV = "SEQPAR_DATA_SHA256"
_KNOWN: dict[str, str] = {}  # stat key -> sha256, this process's

def resolved_path(path: str) -> str:
    """A dataset path as a resume compares it: absolute, symlinks resolved (relative: to the working directory)."""
    return os.path.realpath(path)


def dataset_files(path: str) -> list[Path]:
    """The files a dataset path names, in the order load_rows reads them (a directory: its files, sorted)."""
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.iterdir() if f.is_file())
    return [p] if p.is_file() else []


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.stat().st_size}:".encode())  # length-prefixed: two files never read as one
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _stat_key(files: list[Path]) -> str:
    """What says the files are the ones hashed before: their paths, sizes and modification times."""
    return json.dumps([[os.path.realpath(f), (st := f.stat()).st_size, st.st_mtime_ns] for f in files])


def file_hash(path: str) -> str:
    """sha256 of the dataset's file bytes: handed on (DATA_HASH_ENV) or kept (this process) when the files are
    unchanged, else read."""
    files = dataset_files(path)
    key = _stat_key(files)
    if key not in _KNOWN:
        try:
            given = json.loads(os.environ.get(DATA_HASH_ENV, "{}"))
        except ValueError:
            given = {}
        _KNOWN[key] = given["sha256"] if given.get("key") == key else _hash_files(files)
    return _KNOWN[key]


def export_file_hash(path: str) -> None:
    """Hand the dataset's file hash to processes started from this one (the launcher's ranks)."""
    os.environ[DATA_HASH_ENV] = json.dumps({"key": _stat_key(dataset_files(path)), "sha256": file_hash(path)})


def _feed(h: Any, x: Any) -> None:
    """Hash `x` by structure and value (each item tagged with its kind, containers with their length)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(x, dict):
        h.update(f"D{len(x)}".encode())
        for k in sorted(x, key=str):
            _feed(h, str(k))
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        if x and all(type(v) is int for v in x):  # token ids: one buffer, not one update per id
            h.update(f"I{len(x)}".encode())
            h.update(torch.tensor(x, dtype=torch.int64).numpy().tobytes())
        else:
            h.update(f"L{len(x)}".encode())
            for v in x:
                _feed(h, v)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        _feed(h, {f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    else:
        h.update(f"{type(x).__name__}:{x!r}|".encode())


def fingerprint(examples: list) -> str:
    """sha256 of the examples (dicts, packed lists of dicts, GRPO prompt rows), order included."""
    h = hashlib.sha256()
    _feed(h, examples)
    return h.hexdigest()


@dataclass(frozen=True)
class DataIdentity:
    """rows: the number of examples (what the data position counts); path: dataset.path resolved; files: sha256 of
    its file bytes; examples: fingerprint() of the examples as trained."""

    rows: int
    path: str
    files: str
    examples: str

    def meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changes(self, saved: dict[str, Any]) -> tuple[list[str], list[str]]:
        """What differs from a checkpoint's record `saved` (DataIdentity.meta()): (refusals, notes). The examples'
        fingerprint decides; a moved path with the same examples is a note."""
        moved = resolved_path(saved.get("path", self.path)) != self.path
        where = f"dataset.path: {saved.get('path')!r} -> {self.path!r}"
        if saved.get("examples") == self.examples:
            notes = [f"{where}: the same data (its examples' fingerprint matches)"] if moved else []
            if saved.get("files") != self.files:
                notes.append(f"the dataset file(s) at {self.path} changed since that run, but not the examples trained "
                             "on (the changes are cut by max_length, or do not reach the tokens): continuing")
            return [], notes
        rows = f" ({saved.get('rows')} -> {self.rows} examples)" if saved.get("rows") != self.rows else ""
        if saved.get("files") != self.files:
            what = (f"{where}, with other content" if moved else
                    f"the dataset file(s) at {self.path} changed since that run (content sha256 "
                    f"{str(saved.get('files'))[:12]} -> {self.files[:12]})")
            return [what + rows], []
        return [f"its examples differ though the dataset file(s) at {self.path} are unchanged{rows}: the tokenizer, "
                "its chat template (dataset.chat_template, or the file it names) or the images / videos the rows "
                "name changed"], []


def data_identity(path: str, examples: list) -> DataIdentity:
    """The identity of `examples`, built from the dataset at `path`."""
    return DataIdentity(len(examples), resolved_path(path), file_hash(path), fingerprint(examples))
