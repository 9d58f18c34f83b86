"""Spawn N gloo processes, run a function on each, gather results — always with a timeout.

Used by the test suite, the benchmarks and `seqpar verify`. Each rank runs with 1 thread.
Rendezvous uses a fresh free TCP port on 127.0.0.1. Ranks start by multiprocessing's "spawn" (a fresh interpreter
each: about 2 s of CPU importing torch and transformers per rank); $SEQPAR_START_METHOD=forkserver forks them
instead from one server process that imported those once (the test suite sets it: many short worlds), and each
rank takes the caller's environment, working directory, stdout and stderr at the call, as a spawned one would.
A harness with its own time limit (the test suite: each test's timeout) sets $SEQPAR_SPAWN_DEADLINE to the
wall-clock time (time.time()) by which every spawned world must be over: a `timeout` that reaches past it is cut to
it, so the harness's own limit never kills a world it cannot report on.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import SeqParError

__all__ = ["run_distributed", "free_port", "DistributedFailure", "DEADLINE_ENV", "START_METHOD_ENV", "capped_timeout"]

DEADLINE_ENV = "SEQPAR_SPAWN_DEADLINE"
START_METHOD_ENV = "SEQPAR_START_METHOD"
_PRELOAD = ["torch", "torch.distributed", "transformers", "seqpar.hf"]  # what a forkserver imports once


class DistributedFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capped_timeout(timeout: float) -> tuple[float, str]:
    """(timeout cut to $SEQPAR_SPAWN_DEADLINE's time left, at least 1 s; what cut it, or "")."""
    deadline = os.environ.get(DEADLINE_ENV)
    if deadline:
        left = max(1.0, float(deadline) - time.time())
        if left < timeout:
            return left, f" (cut from {timeout:.0f}s to the caller's deadline, ${DEADLINE_ENV})"
    return timeout, ""


class _Caller:
    """What a rank takes from the caller at the call: its environment, working directory and stdout / stderr (a
    forkserver child
    would otherwise have the server's, i.e. whatever they were when the first world of the process started; pickled
    for the child, the two descriptors travel as duplicates, as multiprocessing passes its own pipes)."""

    def __init__(self) -> None:
        self.env, self.cwd = dict(os.environ), os.getcwd()
        self.stdout: int | None = None  # descriptors: set in the rank (_rebuild_caller)
        self.stderr: int | None = None

    def __reduce__(self) -> tuple:
        return _rebuild_caller, (self.env, self.cwd, reduction.DupFd(1), reduction.DupFd(2))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        for fd, target in ((1, self.stdout), (2, self.stderr)):
            if target is not None and target != fd:  # spawn passes them at their own numbers
                (sys.stdout if fd == 1 else sys.stderr).flush()
                os.dup2(target, fd)
                os.close(target)


def _rebuild_caller(env: dict[str, str], cwd: str, stdout: Any, stderr: Any) -> _Caller:
    caller = _Caller.__new__(_Caller)
    caller.env, caller.cwd, caller.stdout, caller.stderr = env, cwd, stdout.detach(), stderr.detach()
    return caller


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, kwargs: dict, out_dir: str, threads: int,
            caller: _Caller):
    caller.apply()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args, **kwargs)
        payload = ("ok", result)
    except BaseException as e:  # report every failure to the parent, with its traceback
        payload = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(path + ".tmp", path)
    if dist.is_initialized():
        if payload[0] == "ok":
            try:
                dist.barrier()
            except Exception:
                pass
        dist.destroy_process_group()


def _context() -> Any:
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in ("spawn", "forkserver"):
        raise SeqParError(f"${START_METHOD_ENV}={method!r}: use 'spawn' (the default) or 'forkserver' (ranks as "
                          "threads of one process: seqpar.threaded.run_threaded, a test harness, no start method)")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first world): no effect later
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return the per-rank results (rank order).

    fn must be importable (module level). Raises DistributedFailure with every failing rank's
    traceback, or after `timeout` seconds (all processes are killed: a test never hangs).
    """
    timeout, cut = capped_timeout(timeout)
    ctx = _context()
    port, caller = free_port(), _Caller()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, out_dir, threads, caller),
                        daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            _wait_for_ranks(procs, out_dir, deadline, f"{timeout:.0f}s{cut}", results, errors)
            if not errors:
                for p in procs:
                    p.join(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if errors:
            raise DistributedFailure("\n\n".join(errors))
        return [results[r] for r in range(world_size)]


def _wait_for_ranks(procs: list, out_dir: str, deadline: float, timeout: str, results: dict[int, Any],
                    errors: list[str]) -> None:
    """Collect each rank's result file into `results` (or its traceback into `errors`) until all reported, one
    failed (the others get a moment to report: they may be blocked in a collective), one died, or time is up."""
    world_size = len(procs)
    while len(results) + len(errors) < world_size:
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if r in results or os.path.exists(path + ".done"):
                continue
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value = pickle.load(f)
                os.rename(path, path + ".done")
                if status == "ok":
                    results[r] = value
                else:
                    errors.append(value)
        if errors:
            time.sleep(1.0)
            return
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
        if dead:
            errors.append(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
            return
        if time.monotonic() > deadline:
            errors.append(f"timed out after {timeout}; finished ranks: {sorted(results)}")
            return
        time.sleep(0.02)
