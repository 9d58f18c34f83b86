"""This process within the run: the process group (env://, per-attempt keys after a torchrun restart, the
run's collective timeout), the output_dir lock agreed by every rank (over nodes that may or may not share
the folder: rank 0's view decides), quiet non-main ranks, and the test-only fault hook.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ... import comm
from ...errors import SeqParError
from ..config import TrainConfig
from .lock import OutputDirLock

__all__ = ["FAULT_ENV", "maybe_fault", "quiet_non_main_ranks", "init_process_group", "take_lock", "watch_parent",
           "LAUNCHER_GONE", "rank0_decides"]

LAUNCHER_GONE = 143  # the exit code of a rank that stopped because its launcher died (as if SIGTERMed)


# Test-only fault injection: the rank SEQPAR_FAULT_RANK (default: the last) exits right after
# optimizer step SEQPAR_FAULT_AFTER_STEP, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0).
FAULT_ENV = "SEQPAR_FAULT_AFTER_STEP"


def maybe_fault(step: int, rank: int, world: int) -> None:
    at = os.environ.get(FAULT_ENV)
    if at is None or int(at) != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if rank == int(os.environ.get("SEQPAR_FAULT_RANK", world - 1)):
        print(f"[seqpar] fault hook: rank {rank} exits after step {step}", flush=True)
        os._exit(13)


# ----------------------------------------------------------------------------- the loop
def quiet_non_main_ranks() -> None:
    """One rank talks: other ranks' HF/datasets progress bars and info logs are noise (errors still show)."""
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # raised inside peft
    if int(os.environ.get("RANK", "0")) == 0:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def init_process_group(backend: str, timeout: timedelta | None = None) -> None:
    """env:// init with `timeout` for its collectives (None: torch's default); after a torchrun restart,
    under a per-attempt key prefix.

    torchrun's store outlives a failed attempt, and gloo's rendezvous keys do not change between
    attempts: a restarted rank could read the dead rank's address ("connectFullMesh ... Connection
    refused"). A prefix per TORCHELASTIC_RESTART_COUNT keeps each attempt's keys apart.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0:
        dist.init_process_group(backend, timeout=timeout)
        return
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"seqpar_attempt_{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def rank0_decides(fn: Callable[[], Any], world: int, rank: int) -> Any:
    """fn() on rank 0 alone, and its value -- or its SeqParError -- on every rank (one broadcast). For
    decisions that read output_dir: nodes need not share that folder, so rank 0's view decides for all."""
    value, err = None, None
    if rank == 0:
        try:
            value = fn()
        except SeqParError as e:
            err = str(e)
    if world > 1:
        err, value = comm.broadcast_object((err, value), 0, _device())
    if err is not None:
        raise SeqParError(err)
    return value


def take_lock(cfg: TrainConfig, world: int, rank: int, check_dir: Callable[[], Any] | None = None) -> OutputDirLock:
    """Rank 0 locks output_dir (over several nodes it also runs the output_dir checks there, `check_dir`: one
    node's ranks all run them before the process group; its result is not None when the run resumes); its
    outcome is the first collective, so every rank stops alike.
    Then every rank that sees the lock file holds it too (lock.py: a rank outliving its launcher keeps the
    folder locked). Nodes that do not see rank 0's lock file do not share output_dir: they write nothing
    there, and checkpoints (every rank writes its part, every rank reads them back) are refused."""
    lock = OutputDirLock(cfg.output_dir)

    def acquire() -> tuple[str, bool]:
        lock.acquire()
        try:
            found = check_dir() if check_dir is not None else None
            return lock.path.read_text(), found is not None
        except BaseException:
            lock.release()
            raise

    stamp, resumes = rank0_decides(acquire, world, rank)
    sees, everywhere = _sees(lock, stamp, world)
    if not everywhere and (cfg.checkpoint.every or resumes):
        if rank == 0:
            lock.release()
        why, fix = (("resume from a checkpoint there, which every rank reads", "start fresh elsewhere with "
                     "checkpoint.every: 0") if resumes else
                    ("write checkpoints, which every rank writes its part of (and a resume reads back)",
                     "set checkpoint.every: 0"))
        raise SeqParError(
            f"output_dir {cfg.output_dir!r} is not on a filesystem every node shares (some ranks do not see the lock "
            f"file rank 0 wrote there), and this run would {why}: put output_dir on a shared filesystem (NFS, "
            f"Lustre, ...), or {fix} (rank 0's node then writes every result alone)")
    if rank != 0 and sees:
        lock.join()
    return lock


def _sees(lock: OutputDirLock, stamp: str, world: int) -> tuple[bool, bool]:
    """(this rank reads rank 0's lock file, every rank does)."""
    try:
        sees = lock.path.read_text() == stamp
    except OSError:
        sees = False
    if world == 1:
        return sees, sees
    every = comm.all_reduce_values([float(sees)], dist.group.WORLD, _device(), op=dist.ReduceOp.MIN)[0] > 0
    return sees, bool(every)


def watch_parent(poll_s: float = 0.5) -> None:
    """A rank started by a launcher (`seqpar train --nproc-per-node`, torchrun) stops when that launcher dies
    (kill -9 included): a daemon thread notices the parent change and ends the process, so no orphan keeps
    training and writing into output_dir. One-process runs are not watched."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "SEQPAR_LAUNCHER_PID" not in os.environ:
        return
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(f"[seqpar] rank {os.environ.get('RANK', '?')}: its launcher (pid {parent}) is gone: stopping",
                      file=sys.stderr, flush=True)
                os._exit(LAUNCHER_GONE)

    threading.Thread(target=watch, name="seqpar-parent-watch", daemon=True).start()
