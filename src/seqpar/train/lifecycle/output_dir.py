"""What happens to an existing output_dir (docs/training.md, "The output folder").

- It has a checkpoint and checkpoint.resume is true (the default): the run resumes from it.
- `latest` names a checkpoint that is missing or incomplete: the newest complete checkpoint-N is used
  instead, with a line saying so (never a silent fresh start over checkpoints).
- Otherwise the run starts fresh. If the folder already holds a run's results (metrics, final/, checkpoints,
  ...) a fresh start would replace them: it is refused, naming them, unless `overwrite_output_dir: true`
  (`--overwrite`), which removes them first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ...errors import SeqParError
from .checkpoint import checkpoint_dirs

__all__ = ["RESULT_FILES", "existing_results", "complete_checkpoints", "checkpoint_damage", "refuse_overwrite",
           "clear_results"]

# What `seqpar train` writes into output_dir (besides the lock): a fresh run replaces each of these.
RESULT_FILES = ("metrics.jsonl", "config.json", "mesh.txt", "loss.png", "final_state.pt", "final", "tensorboard",
                "latest")


def complete_checkpoints(out: Path) -> list[Path]:
    """checkpoint-N folders whose save finished (DCP metadata and rank 0's trainer state), oldest first."""
    return [p for p in checkpoint_dirs(out) if (p / ".metadata").is_file() and (p / "trainer_state_rank0.pt").is_file()]


def checkpoint_damage(ckpt: Path) -> str | None:
    """What is wrong with a finished checkpoint's files (None: intact): every byte range its DCP metadata
    names must exist, and every rank's trainer state must be non-empty. Reads sizes only (same on every rank)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is damage
        return f"its .metadata cannot be read ({type(e).__name__})"
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, n in sorted(need.items()):
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size < n:
            return f"{name} is truncated ({f.stat().st_size} of {n} bytes)"
    empty = [f.name for f in ckpt.glob("trainer_state_rank*.pt") if f.stat().st_size == 0]
    return f"{empty[0]} is empty" if empty else None


def _metrics_steps(path: Path) -> int:
    steps = set()
    for line in path.read_text().splitlines():
        try:
            steps.add(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return len(steps)


def existing_results(out: Path) -> list[str]:
    """What a fresh start into `out` would replace, as short descriptions (empty: nothing)."""
    if not out.is_dir():
        return []
    found = []
    for name in RESULT_FILES:
        p = out / name
        if name == "metrics.jsonl" and p.is_file():
            n = _metrics_steps(p)
            if n:
                found.append(f"metrics.jsonl ({n} steps)")
        elif name not in ("metrics.jsonl", "latest") and p.exists():
            found.append(name + ("/" if p.is_dir() else ""))
    found += [p.name + "/" for p in sorted(out.glob("checkpoint-*")) if p.is_dir()]
    return found


def refuse_overwrite(out: Path, overwrite: bool) -> None:
    """A fresh start over earlier results: refused unless overwrite (the caller decided it is a fresh start)."""
    found = existing_results(out)
    if found and not overwrite:
        raise SeqParError(
            f"output_dir {str(out)!r} already holds a run's results ({', '.join(found)}) and this run would start "
            f"fresh and replace them: resume that run (checkpoint.resume: true needs one of its checkpoints), use "
            f"another output_dir, or set overwrite_output_dir: true (--overwrite) to replace them"
        )


def clear_results(out: Path) -> list[str]:
    """overwrite_output_dir: remove the earlier run's results (rank 0, before the fresh run writes)."""
    removed = existing_results(out)
    for name in RESULT_FILES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for p in out.glob("checkpoint-*"):
        if p.is_dir():
            shutil.rmtree(p)
    return removed
