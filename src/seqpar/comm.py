"""The only module that calls torch.distributed collectives.

Every wrapper counts the bytes this rank sends into a `CommStats` (held by the mesh) so benchmarks
can compare real traffic to the theoretical minimum. A group of None or of size 1 is a no-op.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CommStats",
    "group_size",
    "group_rank",
    "all_to_all",
    "all_reduce",
    "all_reduce_",
    "all_gather",
    "RingComm",
]


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
) -> torch.Tensor:
    """Differentiable all-to-all: split `scatter_dim` across ranks, concatenate along `gather_dim`."""
    if group_size(group) == 1:
        return x
    if x.shape[scatter_dim] % group_size(group) != 0:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} not divisible by group")
    return _AllToAll.apply(x, group, scatter_dim, gather_dim, stats, channel)


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


def all_reduce(x: torch.Tensor, group: Any, stats: CommStats | None = None) -> torch.Tensor:
    """Differentiable sum all-reduce. Backward all-reduces (sums) the incoming gradients."""
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group, stats)


def all_reduce_(x: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    """In-place, non-differentiable all-reduce (for counts, metrics and gradients)."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=group)
    return x


def all_gather(x: torch.Tensor, group: Any, dim: int = 0, stats: CommStats | None = None) -> torch.Tensor:
    """Differentiable all-gather along `dim` (rank order). Backward is a sum reduce-scatter.

    Uses the functional-collectives autograd op, which is correct on subgroups that exclude
    global rank 0 (torch.distributed.nn.functional.all_gather is not).
    """
    p = group_size(group)
    if p == 1:
        return x
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

    if stats is not None:
        stats.add("all_gather", _nbytes(x) * (p - 1))
    xt = x.movedim(dim, 0).contiguous()
    out = gather(xt, gather_dim=0, group=group)
    return out.movedim(0, dim)


class RingComm:
    """Point-to-point ring: send to ring rank r+1, receive from r-1, with batch_isend_irecv.

    `start` posts the transfer and returns at once so compute can overlap; `wait` returns the
    received tensors.
    """

    def __init__(self, group: Any, stats: CommStats | None = None, channel: str = "ring", tag: int = 0) -> None:
        self.group = group
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
