"""This process within the run: the process group (env://, per-attempt keys after a torchrun restart),
the output_dir lock agreed by every rank, quiet non-main ranks, and the test-only fault hook.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

from ... import comm
from ...errors import SeqParError
from ..config import TrainConfig
from .lock import OutputDirLock

__all__ = ["FAULT_ENV", "maybe_fault", "quiet_non_main_ranks", "init_process_group", "take_lock", "watch_parent",
           "LAUNCHER_GONE"]

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


def init_process_group(backend: str) -> None:
    """env:// init; after a torchrun restart, under a per-attempt key prefix.

    torchrun's store outlives a failed attempt, and gloo's rendezvous keys do not change between
    attempts: a restarted rank could read the dead rank's address ("connectFullMesh ... Connection
    refused"). A prefix per TORCHELASTIC_RESTART_COUNT keeps each attempt's keys apart.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0:
        dist.init_process_group(backend)
        return
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"seqpar_attempt_{restart}", store), rank=rank,
                            world_size=world)


def take_lock(cfg: TrainConfig, world: int, rank: int) -> OutputDirLock:
    """Rank 0 locks output_dir; its outcome is the first collective, so every rank stops alike. Then every
    rank holds the lock file too (lock.py: a rank outliving its launcher keeps the folder locked)."""
    lock = OutputDirLock(cfg.output_dir)
    err = None
    if rank == 0:
        try:
            lock.acquire()
        except SeqParError as e:
            err = str(e)
    if world > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        err = comm.broadcast_object(err, 0, device)
    if err is not None:
        raise SeqParError(err)
    if rank != 0:
        lock.join()
    return lock


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
