"""A world of N ranks as threads of one process, on one device: a test harness, not a launcher.

`run_threaded(fn, world_size, *args, device=...)` runs fn on every rank of a world whose collectives are torch's
multi-threaded process group (torch.testing's `ProcessLocalGroup`: all_to_all_single, all_reduce, all_gather,
reduce_scatter, broadcast, barrier and the object collectives, synchronous), with the point-to-point operations
the ring and the recurrent state passing use (isend / irecv / batch_isend_irecv) added here: a mailbox per
(group, source, destination, tag), matched first in first out as NCCL and gloo match them; the sender clones its
tensor in its own thread, the receiver copies it in its own `wait()` (so each thread's op counts stay its own).

What it gives: bitwise what gloo processes give where values move without being added (all-to-all, point-to-point,
gathers: attention in every mode); a float sum over 3+ ranks (all_reduce, reduce_scatter) adds in torch.testing's
order, not gloo's ring order, so it equals gloo's to rounding only. CPU time of a rank: `cpu_time()`.

What it is for: SP > 1 equivalences that test nothing of processes or of gloo run here in a fraction of a
spawn's time (no interpreter per rank), and on ONE GPU: NCCL refuses two ranks on one device, so this is the
only way to run the SP > 1 CUDA kernels (Ulysses, ring, USP) on a single-GPU machine (`make test-gpu`,
`python -m seqpar.bench gpu`). Users keep torchrun with NCCL or gloo.

Process-global state the ranks share, and how it is handled:
- autograd's multithreaded backward is off while a world runs (torch.testing's install does it);
- the device: every rank uses `device` (set as the thread's current CUDA device), and the default group says so
  (`comm_device_type`), which `seqpar.mesh` reads for the mesh's device type;
- the process-global RNG (model construction seeds it) and anything else not thread-safe: `serial()`, a lock
  that code holds around such a section (a no-op cost outside a threaded world);
- environment variables, the working directory, sys.stdout and os._exit are the process's: functions run here
  must not depend on per-rank values of them (they get rank and world from torch.distributed).
One threaded world runs at a time per process. A rank that fails ends the others' collectives (they raise), and
a world that outlives `timeout` is reported with the ranks still running (threads cannot be killed: they are
daemons, left to finish or to die with the process).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_threaded", "serial", "cpu_time", "in_threaded_world", "BACKEND", "COMM_RANGE"]

BACKEND = "seqpar_threads"
_WORLD_LOCK = threading.Lock()  # one threaded world at a time
_SERIAL = threading.RLock()
_MAILBOX: dict[tuple, queue.SimpleQueue] = {}
_MAILBOX_LOCK = threading.Lock()
_registered = False
_GENERATION = [0]  # the threaded world being run (one at a time)


class _Stopped(RuntimeError):
    """This rank stopped because another one failed."""


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Hold the process-wide lock around code that uses process-global state (seeding and drawing from torch's
    global RNG while a model is built): ranks that are threads take turns there, as processes never need to."""
    with _SERIAL:
        yield


def in_threaded_world() -> bool:
    """Whether this thread is a rank of a threaded world."""
    return dist.is_initialized() and str(dist.get_backend()) == BACKEND


def cpu_time() -> float:
    """CPU seconds of this rank so far: the process's (gloo's transfer threads included) when the rank is a
    process; its own thread's when ranks are threads of one process, whose process_time() holds every rank's (the
    CPU of torch's intra-op worker threads is then not counted)."""
    return time.thread_time() if in_threaded_world() else time.process_time()


def _box(key: tuple) -> queue.SimpleQueue:
    with _MAILBOX_LOCK:
        return _MAILBOX.setdefault(key, queue.SimpleQueue())


COMM_RANGE = "seqpar.threaded.transfer"  # the profiler range of every collective / point-to-point copy
_COLLECTIVES = ("all_to_all_single", "alltoall_base", "alltoall", "allreduce", "allreduce_coalesced", "allgather",
                "all_gather_single", "_allgather_base", "broadcast", "reduce_scatter", "reduce_scatter_single",
                "_reduce_scatter_base", "scatter", "gather", "barrier")


def _ranged(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch.profiler.record_function(COMM_RANGE):
            return fn(*args, **kwargs)

    return call


def _recv_work_class(mtpg):
    """A receive's Work: wait() takes the message from the mailbox (or stops when another rank failed)."""

    class RecvWork(dist.Work):
        def __init__(self, key: tuple, tensors: list[torch.Tensor]) -> None:
            super().__init__()
            self._key, self._tensors, self._done = key, tensors, False

        @_ranged
        def wait(self, timeout=None) -> bool:
            if self._done:
                return True
            box = _box(self._key)
            while True:
                if mtpg.ProcessLocalGroup._terminate.is_set():
                    raise _Stopped("another rank failed while this one waited in a receive")
                try:
                    got = box.get(timeout=0.05)
                    break
                except queue.Empty:
                    continue
            for dst, src in zip(self._tensors, got):
                dst.detach().copy_(src)
            self._done = True
            return True

        def is_completed(self) -> bool:
            return self._done

    return RecvWork


def _key_collectives_by_world(mtpg) -> None:
    """ProcessLocalGroup matches collectives by group name, and names repeat in every world: keyed by world too, so
    a rank left over from an earlier world (timed out, still running) never meets this world's ranks."""

    def start_coll(cls, collective, pg):
        with cls._coll_lock:
            key = (getattr(pg, "_generation", None), pg.pg_name)
            if key not in cls._cur_coll_on_pgs:
                cls._cur_coll_on_pgs[key] = mtpg.Collective(pg.size(), collective, cls)
            return cls._cur_coll_on_pgs[key]

    def end_coll(cls, collective, pg):
        with cls._coll_lock:
            key = (getattr(pg, "_generation", None), pg.pg_name)
            if cls._cur_coll_on_pgs.get(key) is collective:
                cls._cur_coll_on_pgs.pop(key)

    mtpg.ProcessLocalGroup._start_coll = classmethod(start_coll)
    mtpg.ProcessLocalGroup._end_coll = classmethod(end_coll)


@functools.cache
def _group_class():
    """ProcessLocalGroup with point-to-point operations (imported lazily: torch.testing is heavy). Its collectives
    keep their state on ProcessLocalGroup itself (reset and stopped there)."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    recv_work = _recv_work_class(mtpg)

    class ThreadRankGroup(mtpg.ProcessLocalGroup):
        def __init__(self, rank, world_size):
            super().__init__(rank, world_size)
            self._generation = _GENERATION[0]

        @_ranged
        def send(self, tensors, dst, tag=0):
            _box((self._generation, self.pg_name, self._rank, dst, tag)).put([t.detach().clone() for t in tensors])
            return mtpg.ret_work(tensors)

        def recv(self, tensors, src, tag=0):
            return recv_work((self._generation, self.pg_name, src, self._rank, tag), tensors)

        def getBackendName(self):
            return BACKEND

    for name in _COLLECTIVES:  # a profiler range around each, so a profile tells transfers from compute
        # only its own Python methods (the names differ between torch releases; a C++ base method must stay as is)
        if name in vars(mtpg.ProcessLocalGroup):
            setattr(ThreadRankGroup, name, _ranged(vars(mtpg.ProcessLocalGroup)[name]))
    _key_collectives_by_world(mtpg)
    return mtpg, ThreadRankGroup


def _install():
    """The thread-local c10d world, and the backend (registered once per process)."""
    global _registered
    mtpg, group_cls = _group_class()
    if not _registered:
        def create(prefix_store, rank, world_size, timeout):
            pg = group_cls(rank, world_size)
            mtpg._store_based_barrier(rank, prefix_store, "", world_size, timeout)
            return pg

        dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
        _registered = True
    mtpg.ProcessLocalGroup.reset()
    _GENERATION[0] += 1
    with _MAILBOX_LOCK:
        _MAILBOX.clear()
    mtpg._install_threaded_pg()
    return mtpg, group_cls


def _rank_main(rank: int, world: int, store, device: torch.device, fn: Callable, args: tuple, kwargs: dict,
               results: dict, errors: dict, group_cls) -> None:
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(BACKEND, rank=rank, world_size=world, store=store)
        # where this world's tensors live, for seqpar.mesh (not init_process_group(device_id=): that binding makes
        # c10d look for a C++ backend to split subgroups from, which a Python process group does not have)
        dist.distributed_c10d._get_default_group().comm_device_type = device.type
        results[rank] = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - every failure is reported, with its traceback
        # a rank stopped because another one failed (torch.testing's collectives raise SystemExit then; a receive
        # raises _Stopped) is reported only when no rank failed first
        secondary = isinstance(e, (SystemExit, _Stopped))
        errors[rank] = (secondary, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        if not secondary:
            group_cls.exception_handle(e)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure
            pass


def run_threaded(fn: Callable[..., Any], world_size: int, *args: Any, device: str | torch.device = "cpu",
                 timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """fn(*args, **kwargs) on `world_size` ranks that are threads of this process; the per-rank results in rank
    order. Raises seqpar.spawn.DistributedFailure with every failing rank's traceback, or after `timeout`."""
    from .spawn import DistributedFailure, capped_timeout

    timeout, cut = capped_timeout(timeout)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not _WORLD_LOCK.acquire(timeout=timeout):
        raise DistributedFailure("another threaded world is still running in this process")
    results: dict[int, Any] = {}
    errors: dict[int, tuple[bool, str]] = {}  # rank -> (stopped by another rank's failure, report)
    mtpg, hook = None, sys.excepthook  # init_process_group wraps the process's excepthook once per rank
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # c10d's group-name registry per thread
    try:
        mtpg, group_cls = _install()
        store = dist.HashStore()
        threads = [threading.Thread(target=_rank_main, name=f"seqpar-rank{r}", daemon=True,
                                    args=(r, world_size, store, device, fn, args, kwargs, results, errors, group_cls))
                   for r in range(world_size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        if alive:
            group_cls.exception_handle(TimeoutError())
            for t in threads:
                t.join(2.0)
            errors[-1] = (False, f"timed out after {timeout:.0f}s{cut}; ranks still running: {alive}")
    finally:
        if mtpg is not None:
            mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        sys.excepthook = hook
        _WORLD_LOCK.release()
    if errors:
        first = [text for r, (secondary, text) in sorted(errors.items()) if not secondary]
        raise DistributedFailure("\n\n".join(first or [text for _, (_, text) in sorted(errors.items())]))
    return [results[r] for r in range(world_size)]
