"""The only module that calls torch.distributed collectives.

Every wrapper counts the bytes this rank sends into a `CommStats` (held by the mesh) so benchmarks
can compare real traffic to the theoretical minimum. A group of None or of size 1 is a no-op.

Device rule (one for every collective): tensors handed to a collective live on the mesh's
communication device, `SequenceParallelMesh.comm_device` (the current CUDA device on an NCCL mesh,
the CPU on gloo). Every wrapper takes `device=` and raises a SeqParError when a tensor is elsewhere
(NCCL would refuse a CPU tensor with a far less helpful error). Host-side numbers (metrics, counts)
go through `all_reduce_values`, which moves them there and back. Strict mode
(env SEQPAR_STRICT_COMM_DEVICE=1) also refuses any collective called WITHOUT `device=`: a CPU test
run in strict mode proves that every call site applies the rule, which a gloo run alone cannot.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .errors import SeqParError

__all__ = [
    "CommStats",
    "group_size",
    "group_rank",
    "all_to_all",
    "all_to_all_split",
    "all_reduce",
    "all_reduce_",
    "all_reduce_async_",
    "all_reduce_many_",
    "in_place_reducible",
    "all_gather",
    "broadcast_object",
    "all_gather_object",
    "agree_on_error",
    "all_reduce_values",
    "RingComm",
    "send_recv",
    "STRICT_DEVICE_ENV",
    "strict_device_checks",
    "check_device",
]

STRICT_DEVICE_ENV = "SEQPAR_STRICT_COMM_DEVICE"


def strict_device_checks() -> bool:
    """Whether strict mode is on (read per call, so a test can switch it on in its worker processes)."""
    return os.environ.get(STRICT_DEVICE_ENV, "0").strip().lower() not in ("", "0", "false", "no")


def check_device(tensors: Iterable[torch.Tensor], device: torch.device | None, what: str) -> None:
    """Raise unless every tensor handed to collective `what` is on `device` (the mesh's comm device)."""
    if device is None:
        if strict_device_checks():
            raise SeqParError(
                f"seqpar.comm.{what} was called without device= ({STRICT_DEVICE_ENV}=1): every collective "
                "must name the mesh's communication device (device=mesh.comm_device)"
            )
        return
    device = torch.device(device)
    for t in tensors:
        if t.device != device:
            raise SeqParError(
                f"seqpar.comm.{what}: a tensor on {t.device} was handed to a collective on a mesh that "
                f"communicates on {device} (NCCL cannot reduce CPU tensors): move it with "
                ".to(mesh.comm_device), or use seqpar.comm.all_reduce_values for host-side numbers"
            )


class CommStats:
    """Bytes sent by this rank, per named channel (e.g. 'ulysses_fwd', 'ring_bwd')."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, channel: str, nbytes: int) -> None:
        self.bytes[channel] += int(nbytes)
        self.calls[channel] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


def group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_to_all_raw(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    p = group_size(group)
    # Chunk i of scatter_dim goes to rank i; chunks received from rank j are concatenated along gather_dim.
    send = torch.stack(torch.chunk(x, p, dim=scatter_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, stats, channel):
        ctx.args = (group, scatter_dim, gather_dim, stats, channel)
        p = group_size(group)
        if stats is not None:
            stats.add(f"{channel}_fwd", _nbytes(x) * (p - 1) // p)
        return _all_to_all_raw(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim, stats, channel = ctx.args
        p = group_size(group)
        if stats is not None:
            stats.add(f"{channel}_bwd", _nbytes(grad) * (p - 1) // p)
        # The adjoint of an all-to-all is the inverse all-to-all (dims swapped).
        return _all_to_all_raw(grad.contiguous(), group, gather_dim, scatter_dim), None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    group: Any,
    scatter_dim: int,
    gather_dim: int,
    stats: CommStats | None = None,
    channel: str = "a2a",
    device: torch.device | None = None,
) -> torch.Tensor:
    """Differentiable all-to-all: split `scatter_dim` across ranks, concatenate along `gather_dim`."""
    if group_size(group) == 1:
        return x
    check_device([x], device, "all_to_all")
    if x.shape[scatter_dim] % group_size(group) != 0:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} not divisible by group")
    return _AllToAll.apply(x, group, scatter_dim, gather_dim, stats, channel)


def all_to_all_split(
    send: torch.Tensor,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    group: Any,
    stats: CommStats | None = None,
    channel: str = "a2a",
    device: torch.device | None = None,
    async_op: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Raw all-to-all of a flat contiguous buffer in uneven pieces: send_sizes[i] elements (in rank order)
    go to rank i, recv_sizes[j] elements come from rank j (recv_sizes[me] == send_sizes[me]). Not
    differentiable. Returns (recv, work): with async_op, call work.wait() before reading recv (work is None
    otherwise)."""
    me = group_rank(group)
    check_device([send], device, "all_to_all_split")
    if send.dim() != 1 or not send.is_contiguous() or send.numel() != sum(send_sizes):
        raise ValueError(f"all_to_all_split: need a flat contiguous buffer of {sum(send_sizes)} elements, "
                         f"got {tuple(send.shape)}")
    if stats is not None:
        stats.add(channel, (send.numel() - send_sizes[me]) * send.element_size())
    recv = send.new_empty(sum(recv_sizes))
    work = dist.all_to_all_single(recv, send, list(recv_sizes), list(send_sizes), group=group, async_op=async_op)
    return recv, work


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        out = x.clone()
        if stats is not None:
            stats.add("all_reduce", _nbytes(out))
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # y = sum_r x_r is used by every rank, so dL/dx_r = sum over ranks of dL/dy (torch.distributed.nn semantics).
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None, None


def all_reduce(
    x: torch.Tensor, group: Any, stats: CommStats | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Differentiable sum all-reduce. Backward all-reduces (sums) the incoming gradients."""
    if group_size(group) == 1:
        return x
    check_device([x], device, "all_reduce")
    return _AllReduceSum.apply(x, group, stats)


def all_reduce_(x: torch.Tensor, group: Any, op: Any = None, device: torch.device | None = None) -> torch.Tensor:
    """In-place, non-differentiable all-reduce (for counts and gradients already on the comm device)."""
    if group_size(group) > 1:
        check_device([x], device, "all_reduce_")
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=group)
    return x


IN_PLACE_MIN_NUMEL = 1 << 16  # elements: tensors this large are reduced where they are, smaller ones share a buffer


def in_place_reducible(t: torch.Tensor) -> bool:
    """Whether `all_reduce_many_` sums t where it is (large and contiguous) rather than in a shared buffer."""
    return t.numel() >= IN_PLACE_MIN_NUMEL and t.is_contiguous()


def all_reduce_async_(x: torch.Tensor, group: Any, device: torch.device | None = None) -> Any:
    """Post a SUM all-reduce of x in place and return its work (x is the sum after work.wait()); None for a
    group of one. Nothing may read or write x before the wait."""
    if group_size(group) <= 1:
        return None
    check_device([x], device, "all_reduce_async_")
    return dist.all_reduce(x, group=group, async_op=True)


def all_reduce_many_(tensors: Sequence[torch.Tensor], group: Any, device: torch.device | None = None) -> None:
    """SUM-all-reduce many tensors in place (gradients): the large contiguous ones where they are (no copy, no
    second buffer the size of all of them), the small ones coalesced per dtype/device into one buffer each.
    All are posted asynchronously before the first wait, so the backend pipelines them."""
    if group_size(group) <= 1 or not tensors:
        return
    check_device(list(tensors), device, "all_reduce_many_")
    works, small = [], {}
    for t in tensors:
        if in_place_reducible(t):
            works.append(dist.all_reduce(t, group=group, async_op=True))
        else:
            small.setdefault((t.dtype, t.device), []).append(t)
    flats = []
    for group_tensors in small.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        works.append(dist.all_reduce(flat, group=group, async_op=True))
        flats.append((flat, group_tensors))
    for w in works:
        w.wait()
    for flat, group_tensors in flats:
        off = 0
        for t in group_tensors:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()


def all_reduce_values(
    values: Sequence[float] | torch.Tensor, group: Any, device: torch.device, op: Any = None
) -> torch.Tensor:
    """Reduce a few host-side numbers (metrics, step stats) over `group`: sent as float64 from the
    mesh's communication device `device`, returned as a float64 CPU tensor (ready for .tolist())."""
    t = torch.as_tensor(values, dtype=torch.float64).detach().to(device)
    return all_reduce_(t, group, op, device=device).cpu()


def broadcast_object(obj: Any, src: int, device: torch.device, group: Any = None) -> Any:
    """A small picklable object from global rank `src` to every rank of `group` (default: the world),
    serialised through `device` (the communication device: NCCL refuses CPU tensors)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """One small picklable object per rank of `group` (default: the world), in rank order. torch
    serialises through the backend's device (the current CUDA device under NCCL)."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def agree_on_error(error: str | None, group: Any = None) -> tuple[int, str] | None:
    """(rank, error) of the lowest rank of `group` (default: the world) that passed an error, None when none did:
    the same answer on every rank (one all_gather_object), so all of them stop together. Without a process group:
    this process's own error."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return None if error is None else (0, error)
    return next(((r, e) for r, e in all_gather_object((dist.get_rank(), error), group) if e is not None), None)


def all_gather(
    x: torch.Tensor, group: Any, dim: int = 0, stats: CommStats | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Differentiable all-gather along `dim` (rank order). Backward is a sum reduce-scatter.

    Uses the functional-collectives autograd op, which is correct on subgroups that exclude
    global rank 0 (torch.distributed.nn.functional.all_gather is not).
    """
    p = group_size(group)
    if p == 1:
        return x
    check_device([x], device, "all_gather")
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

    if stats is not None:
        stats.add("all_gather", _nbytes(x) * (p - 1))
    xt = x.movedim(dim, 0).contiguous()
    out = gather(xt, gather_dim=0, group=group)
    return out.movedim(0, dim)


def send_recv(send: torch.Tensor | None, dst: int | None, recv_like: torch.Tensor | None, src: int | None,
              group: Any, stats: CommStats | None = None, channel: str = "p2p",
              device: torch.device | None = None) -> torch.Tensor | None:
    """Blocking point-to-point inside `group` (dst / src are ranks of the group): send `send` to dst and / or
    receive a tensor shaped like `recv_like` from src (returned; None when nothing is received). Not
    differentiable: callers wrap it in their own autograd Function (seqpar.recurrent.combine)."""
    check_device([t for t in (send, recv_like) if t is not None], device, "send_recv")
    works, out = [], None
    if recv_like is not None:
        out = torch.empty_like(recv_like, memory_format=torch.contiguous_format)
        works.append(dist.irecv(out, dist.get_global_rank(group, src), group=group))
    if send is not None:
        send = send.contiguous()
        if stats is not None:
            stats.add(channel, _nbytes(send))
        works.append(dist.isend(send, dist.get_global_rank(group, dst), group=group))
    for w in works:
        w.wait()
    return out


class RingComm:
    """Point-to-point ring: send to ring rank r+1, receive from r-1, with batch_isend_irecv.

    `start` posts the transfer and returns at once so compute can overlap; `wait` returns the
    received tensors.
    """

    def __init__(
        self, group: Any, stats: CommStats | None = None, channel: str = "ring", tag: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.group = group
        self.device = device
        self.tag = tag
        self.stats = stats
        self.channel = channel
        self.size = group_size(group)
        rank = group_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % self.size) if self.size > 1 else 0
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size) if self.size > 1 else 0
        self._reqs: list = []
        self._recv: list[torch.Tensor] = []

    def start(self, tensors: list[torch.Tensor], channel: str | None = None) -> None:
        if self._reqs:
            raise RuntimeError("RingComm.start called twice without wait")
        check_device(tensors, self.device, "RingComm")
        ops, self._recv = [], []
        for t in tensors:
            t = t.contiguous()
            buf = torch.empty_like(t)
            self._recv.append(buf)
            ops.append(dist.P2POp(dist.isend, t, self.next, group=self.group, tag=self.tag))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, group=self.group, tag=self.tag))
            if self.stats is not None:
                self.stats.add(channel or self.channel, _nbytes(t))
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for r in self._reqs:
            r.wait()
        self._reqs = []
        out, self._recv = self._recv, []
        return out
