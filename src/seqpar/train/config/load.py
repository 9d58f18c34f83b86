"""Reading a run's configuration: a YAML file (paths relative to it) or a dict, plus dotted overrides
(`--set key=value`), into a validated TrainConfig; pydantic's errors become one SeqParError listing
each bad key and its fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ...errors import SeqParError
from ...textfiles import read_text
from .schema import TrainConfig

__all__ = ["config_from_dict", "load_config", "set_dotted"]


def config_from_dict(data: dict[str, Any], source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key: remove it or check its spelling (see docs/training.md)"
            elif err["type"] == "missing":
                msg = "required: add it"
            lines.append(f"  {loc}: {msg}")
        raise SeqParError(f"invalid {source}:\n" + "\n".join(lines)) from None


def load_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML config; `overrides` are dotted keys, e.g. {"max_steps": 5, "sequence_parallel.size": 2}."""
    p = Path(path)
    if not p.is_file():
        raise SeqParError(f"config file {str(p)!r} does not exist: pass the path to a YAML file")
    try:
        data = yaml.safe_load(read_text(p, "config file")) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = (" ".join(x for x in (getattr(e, "problem", None), getattr(e, "context", None)) if x)
                   or str(e).splitlines()[0])
        raise SeqParError(f"{where}: YAML syntax error: {problem}: fix the file") from None
    if not isinstance(data, dict):
        raise SeqParError(f"{p}: the top level must be a mapping of keys (model:, dataset:, ...)")
    _relative_to(data, p.parent)
    for key, val in (overrides or {}).items():
        set_dotted(data, key, val)
    for a, b in (("max_steps", "num_epochs"), ("global_batch_size", "grad_accum")):
        for x, y in ((a, b), (b, a)):
            if x in (overrides or {}) and y not in (overrides or {}):
                data.pop(y, None)  # --max-steps on the command line replaces the file's num_epochs (and back), etc.
    # Override values (CLI --set / --output-dir) keep the caller's working directory as their base, except
    # dataset paths, which fall back to the config directory as before; either way they are stored absolute (a
    # resume compares them with the config file's, which _relative_to made absolute).
    for name in ("dataset", "eval_dataset"):
        ds = data.get(name)
        if isinstance(ds, dict) and isinstance(ds.get("path"), str) and not os.path.isabs(ds["path"]):
            cand = p.parent / ds["path"]
            if Path(ds["path"]).exists():
                ds["path"] = str(Path(ds["path"]).absolute())
            elif cand.exists():
                ds["path"] = str(cand.absolute())
    return config_from_dict(data, source=str(p))


def _relative_to(data: dict[str, Any], base: Path) -> None:
    """Relative paths written in a config file are relative to that file, so configs travel with their data:
    dataset/eval_dataset path (when it exists there) and chat_template file, and output_dir."""
    base = base.absolute()  # a config re-loaded from elsewhere (verify's copies) must not re-resolve them
    for name in ("dataset", "eval_dataset"):
        ds = data.get(name)
        if isinstance(ds, str):
            ds = data[name] = {"path": ds}
        if not isinstance(ds, dict):
            continue
        for key in ("path", "chat_template"):
            v = ds.get(key)
            if isinstance(v, str) and not os.path.isabs(v) and "{" not in v and (base / v).exists():
                ds[key] = str(base / v)
    out = data.get("output_dir")
    if isinstance(out, str) and not os.path.isabs(out):
        data["output_dir"] = str(base / out)


def set_dotted(data: dict[str, Any], key: str, val: Any) -> None:
    parts = key.split(".")
    cur = data
    for part in parts[:-1]:
        nxt = cur.get(part)
        if isinstance(nxt, int) and part == "sequence_parallel":
            nxt = {"size": nxt}
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None else ({"name": nxt} if part == "model" else nxt)
        cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = val
