"""Checkpoint save / resume: model + optimizer (torch.distributed.checkpoint, FSDP-aware, resharded on load at
any world size), plus per-rank trainer state (step, scheduler, data position in global rows, RNG).

Layout: <output_dir>/checkpoint-<step>/{model+optim DCP files, trainer_state_rank<r>.pt, run.json (the
config, world size, layout and data position that wrote it: run_layout.py)}; the file
<output_dir>/latest names the newest COMPLETE checkpoint (written last, atomically, after a
barrier), so a rank killed mid-save never leaves a half checkpoint that resume would pick up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...errors import SeqParError

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "full_model_state", "checkpoint_dirs",
           "checkpoint_step", "first_failure", "latest_name"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only)


def checkpoint_step(path: Path) -> int | None:
    """N of a checkpoint-N folder name (the number after the last '-'; None without one)."""
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """The checkpoint-N folders of output_dir, oldest first (complete or not)."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def latest_name(output_dir: str | Path) -> str | None:
    """What <output_dir>/latest says (None: no such file). Read leniently: a damaged marker names no checkpoint
    that exists, so resume falls back to the newest complete one (resume.checkpoint_to_resume) with a line."""
    marker = Path(output_dir) / "latest"
    if not marker.is_file():
        return None
    return marker.read_bytes().decode("utf-8", "replace").replace("\x00", "").strip()


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    name = latest_name(output_dir)
    if not name:
        return None
    path = Path(output_dir) / name
    return path if path.is_dir() else None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], trainable_only: bool, keep_last: int,
                    run_meta: dict[str, Any] | None = None) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = Path(output_dir)
    path = out / f"checkpoint-{step}"
    if _rank() == 0 and path.exists():
        shutil.rmtree(path)  # a stale partial save of this step (from a killed run)
    _barrier()
    msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
    try:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))  # raises on every rank if one fails
        err = None
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - reworded below, kept as the cause
        err = e  # (DCP's CheckpointException is a BaseException, not an Exception: named on its own)
    if err is None:
        try:  # per rank: a failure here is agreed on below, so no rank waits alone in the next barrier
            torch.save(dict(trainer_state, rng=rng_state()), path / f"trainer_state_rank{_rank()}.pt")
            if _rank() == 0 and run_meta is not None:
                # What produced this checkpoint (config + world size): resume compares it, export rebuilds from it.
                (path / "run.json").write_text(json.dumps(run_meta, indent=2))
        except OSError as e:
            err = e
    if not _all_ok(err is None) or err is not None:
        raise _save_error(err, path, out) from err
    _barrier()
    if _rank() == 0:
        tmp = out / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, out / "latest")
        for old in checkpoint_dirs(out)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def _all_ok(ok: bool) -> bool:
    """Whether every rank's part of the save succeeded (a MIN over the world; True without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    from ... import comm

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return bool(comm.all_reduce_values([float(ok)], dist.group.WORLD, device, op=dist.ReduceOp.MIN)[0] > 0)


def _errors_in(e: BaseException | None) -> list[BaseException]:
    """e, its causes, and the per-rank failures a DCP CheckpointException carries ((exception, stack) pairs)."""
    out, todo = [], [e]
    while todo:
        x = todo.pop()
        if isinstance(x, tuple) and x and isinstance(x[0], BaseException):
            x = x[0]
        if not isinstance(x, BaseException) or any(x is y for y in out):
            continue
        out.append(x)
        todo += [x.__cause__, x.__context__, *(getattr(x, "failures", None) or {}).values()]
    return out


def first_failure(err: BaseException) -> BaseException:
    """The error to name in one line: a CheckpointException's first rank's failure, else err itself."""
    failures = getattr(err, "failures", None) or {}
    for rank in sorted(failures):
        x = failures[rank]
        return x[0] if isinstance(x, tuple) and x and isinstance(x[0], BaseException) else err
    return err


def _save_error(err: BaseException | None, path: Path, out: Path) -> SeqParError:
    """One line: what failed, and which checkpoint is still good (the partial one is removed)."""
    import errno

    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # never leave a partial checkpoint behind (frees space too)
    good = latest_checkpoint(out)
    still = f"{good} is the last good checkpoint" if good is not None else "no earlier checkpoint exists"
    if any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in _errors_in(err)):
        return SeqParError(f"no space left on {path.parent} while saving {path.name}: {still}; free space there (or "
                           f"lower checkpoint.keep_last) and run again to resume")
    first = first_failure(err) if err is not None else None
    what = (f"{type(first).__name__}: {(str(first).splitlines() or [''])[0][:200]}" if first is not None
            else "failed on another rank")
    return SeqParError(f"saving {path} failed ({what}): {still}; fix the cause and run again to resume")


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainable_only: bool, same_world: bool = True) -> dict[str, Any]:
    """Restore model + optimizer in place (DCP reshards them: any world size, plain or FSDP2); return the
    trainer state, with the RNG restored: this rank's own when the world size is the one that saved
    (`same_world`), else rank 0's on every rank (its step, schedule and data position are every rank's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    mine = path / f"trainer_state_rank{_rank()}.pt"
    if not (same_world and mine.is_file()):
        mine = path / "trainer_state_rank0.pt"
    if not mine.is_file():
        raise SeqParError(f"{path} has no trainer state (trainer_state_rank0.pt): it is incomplete; resume from "
                          f"another checkpoint, or use a new output_dir")
    opts = _options(trainable_only)
    msd, osd = get_state_dict(model, optimizer, options=opts)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=str(path))  # raises on every rank if one cannot read its part
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - damaged: say which, and what else there is
        done = [p for p in checkpoint_dirs(path.parent) if checkpoint_step(p) < checkpoint_step(path)]
        other = (f"the previous checkpoint is {done[-1]}: write {done[-1].name} into {path.parent / 'latest'} to "
                 f"resume from it" if done else "no earlier checkpoint exists")
        raise SeqParError(f"checkpoint {path} cannot be read ({type(first_failure(e)).__name__}): it is damaged; "
                          f"{other}, or delete it") from e
    if trainable_only:
        # Only the trainable (LoRA) weights were saved: load non-strictly, then check that exactly the
        # frozen ones are missing.
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    res = set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                         options=opts)
    if trainable_only and res is not None:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        missing = [k for k in res.missing_keys if any(k.endswith(t) or t.endswith(k) for t in trainable)]
        if missing or res.unexpected_keys:
            raise SeqParError(f"checkpoint {path} does not match the model (missing trainable {missing[:3]}, "
                              f"unexpected {list(res.unexpected_keys)[:3]}): resume with the same config")
    trainer_state = torch.load(mine, weights_only=False)
    set_rng_state(trainer_state.pop("rng"))
    return trainer_state


def full_model_state(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict; a collective under FSDP, every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=opts)
