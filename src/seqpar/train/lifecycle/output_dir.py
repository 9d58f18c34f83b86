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
from .checkpoint import checkpoint_dirs, checkpoint_step

__all__ = ["RESULT_FILES", "existing_results", "complete_checkpoints", "checkpoint_damage", "refuse_overwrite",
           "clear_results", "run_folder", "runs_around", "in_run_message", "refuse_nested_output_dir"]

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
    for line in path.read_bytes().decode("utf-8", "replace").splitlines():  # a count only: damage is skipped
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
    found += [p.name + "/" for p in checkpoint_dirs(out)]  # checkpoint-<N> only: a checkpoint-notes/ is not ours
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
    for p in checkpoint_dirs(out):
        shutil.rmtree(p)
    return removed


# Files only a `seqpar train` run (or its checkpoints) writes: a folder holding one of them holds a run. (config.json,
# final/, loss.png are not among them: a Hugging Face model folder has a config.json too.)
RUN_MARKERS = (".seqpar.lock", ".seqpar_run", "latest", "metrics.jsonl", "mesh.txt", "final_state.pt")
CHECKPOINT_MARKERS = (".metadata", "run.json", "trainer_state_rank0.pt")


def run_folder(p: Path) -> str | None:
    """What run `p` is (None: no run): "a checkpoint (...)" or "a run's output_dir (...)", naming what shows it."""
    if not p.is_dir():
        return None
    ckpt = [n for n in CHECKPOINT_MARKERS if (p / n).is_file()]
    if ckpt:
        return f"a checkpoint ({', '.join(ckpt)})"
    found = [n for n in RUN_MARKERS if (p / n).exists() and (n != "latest" or _names_checkpoint(p / n))]
    found += [c.name + "/" for c in checkpoint_dirs(p)]
    return f"a run's output_dir ({', '.join(found[:4])})" if found else None


def _names_checkpoint(f: Path) -> bool:
    """A `latest` file as seqpar writes it (a file of that name elsewhere is not a run's)."""
    try:
        return f.is_file() and f.read_bytes()[:64].startswith(b"checkpoint-")
    except OSError:
        return False


def runs_around(dest: Path) -> list[tuple[Path, str]]:
    """The runs `dest` is or sits inside, innermost first, as (folder, `run_folder`'s description); symbolic links
    resolved. Empty: no run. A tool must not write or replace anything there but the run's own files."""
    here = dest.resolve()
    return [(p, what) for p in (here, *here.parents) if (what := run_folder(p)) is not None]


def in_run_message(dest: Path, runs: list[tuple[Path, str]]) -> tuple[str, Path]:
    """("<dest> is <a run ...>" or "<dest> is inside <folder>, <a run ...>", a folder next to the outermost run
    to suggest instead); `runs`: `runs_around(dest)`, not empty."""
    folder, what = runs[0]
    where = f"{dest} is {what}" if folder == dest.resolve() else f"{dest} is inside {folder}, {what}"
    root = runs[-1][0]
    return where, root.parent / f"{root.name}-export"


def refuse_nested_output_dir(out: Path) -> None:
    """A run's output_dir may be a run (it resumes) or sit inside one (verify's sp/ and ref/ do), but not be or
    sit inside a checkpoint, nor sit inside another run's checkpoint-N/, final/ or tensorboard/: that run's
    checkpoint rotation, export or --overwrite would delete it. SeqParError naming the folder."""
    here = out.resolve()
    for folder, what in runs_around(out):
        if what.startswith("a checkpoint"):
            where = f"is {what}" if folder == here else f"is inside {folder}, {what}"
            raise SeqParError(f"output_dir {out} {where}: a run never writes into a checkpoint (its run deletes "
                              f"or replaces it): use a folder outside {folder.parent}")
        if folder == here:
            continue  # a run's own output_dir: resume / overwrite rules
        first = here.relative_to(folder).parts[0]
        if first in RESULT_FILES or (first.startswith("checkpoint-") and checkpoint_step(Path(first)) is not None):
            raise SeqParError(f"output_dir {out} is inside {folder / first}, which the run in {folder} replaces or "
                              f"deletes (checkpoint rotation, its export, --overwrite): use a folder outside it")
