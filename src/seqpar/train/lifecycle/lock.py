"""One run per output_dir: <output_dir>/.seqpar.lock holds {pid, host, started, run_id}.

A second run into the same folder refuses with a message naming the owner. Every process of the run (the
launcher and each rank) also holds a shared OS lock (flock) on the file for as long as it lives, so a lock
counts as stale only when its owner pid is gone AND no process of that run still holds the file: a rank
orphaned by a killed launcher keeps its run's folder locked until it exits (and it exits: see
process.watch_parent). A lock from another host cannot be checked: it is reported, and the message says to
delete it when no run is active there. Released at exit, also on errors.

Who holds it (`run_identity`):
- `seqpar train --nproc-per-node N`: the launching process, before torchrun starts; it passes
  SEQPAR_RUN_ID to the ranks, whose rank 0 then finds "its" lock.
- plain `torchrun`: rank 0, in the name of its torchrun agent (the parent process), so a torchrun
  restart (--max-restarts) finds its own lock; rank 0 shares the outcome with every rank before any
  other collective (`seqpar.train.run`), so all ranks stop together.
- one process: itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from ...errors import SeqParError

__all__ = ["OutputDirLock", "run_identity", "LOCK_NAME", "RUN_ID_ENV"]

LOCK_NAME = ".seqpar.lock"
RUN_ID_ENV = "SEQPAR_RUN_ID"


def run_identity() -> tuple[str, int]:
    """(run_id, owner pid) of this process's run (see the module docstring)."""
    if os.environ.get(RUN_ID_ENV):
        return os.environ[RUN_ID_ENV], int(os.environ.get("SEQPAR_LAUNCHER_PID", os.getppid()))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        agent = os.getppid()
        return f"torchrun:{socket.gethostname()}:{agent}:{os.environ['TORCHELASTIC_RUN_ID']}", agent
    return uuid.uuid4().hex, os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class OutputDirLock:
    """`acquire()` raises SeqParError when another live run holds output_dir; `release()` is idempotent."""

    def __init__(self, output_dir: str | os.PathLike, run_id: str | None = None, pid: int | None = None) -> None:
        rid, owner = run_identity()
        self.path = Path(output_dir) / LOCK_NAME
        self.run_id = run_id or rid
        self.pid = pid if pid is not None else owner
        self.owned = False  # True when this process created the file (and so removes it)
        self._fd: int | None = None  # our shared flock on the file, held while this process runs

    def _info(self) -> dict[str, Any]:
        return {"pid": self.pid, "host": socket.gethostname(), "run_id": self.run_id,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable / half-written: treated as stale

    def _refusal(self, info: dict[str, Any], orphans: bool = False) -> SeqParError:
        here = info.get("host") == socket.gethostname()
        who = f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"
        if orphans:
            return SeqParError(f"output_dir {str(self.path.parent)!r} is in use: the run that locked it ({who}) is "
                               f"gone but some of its processes still hold {self.path}: wait for them to exit "
                               f"(they stop by themselves) or stop them, or use another output_dir")
        hint = ("wait for it to finish or stop it" if here else
                f"if no run is active on {info.get('host')}, delete {self.path}")
        return SeqParError(f"output_dir {str(self.path.parent)!r} is in use by another seqpar run ({who}): {hint}, "
                           f"or use another output_dir")

    def _hold(self) -> None:
        """A shared flock on the lock file for this process's lifetime (the kernel drops it when we die)."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:  # a filesystem without flock: the pid check alone
            os.close(fd)
            return
        self._fd = fd

    def _held_by_a_live_process(self) -> bool:
        """Some process (a rank whose launcher died, say) still holds the file."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
        return False

    def join(self) -> None:
        """A rank other than the one that acquired: hold the run's lock file too (after acquire succeeded)."""
        self._hold()

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SeqParError(f"output_dir {str(self.path.parent)!r} cannot be created ({e.strerror}): "
                              f"use a writable folder") from None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self._read()
                if info is None:
                    continue  # released between our open and read: try again
                if info.get("run_id") == self.run_id:
                    self._hold()
                    return  # our own run's lock (taken by the launcher, or before a torchrun restart)
                if info and (info.get("host") != socket.gethostname() or _alive(int(info.get("pid", -1)))):
                    raise self._refusal(info) from None
                if self._held_by_a_live_process():
                    raise self._refusal(info or {}, orphans=True) from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            except PermissionError:
                raise SeqParError(f"output_dir {str(self.path.parent)!r} is not writable: use a writable folder "
                                  f"(--output-dir or output_dir:)") from None
            with os.fdopen(fd, "w") as f:
                json.dump(self._info(), f)
            self.owned = True
            self._hold()
            return
        raise SeqParError(f"could not take the lock {self.path} (it keeps changing): is another run starting "
                          f"into the same output_dir? Use another output_dir")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self.owned:
            return
        info = self._read()
        if info is not None and info.get("run_id") == self.run_id:
            self.path.unlink(missing_ok=True)
        self.owned = False

    def __enter__(self) -> OutputDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
