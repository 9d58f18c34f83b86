"""Gradient sums overlapped with backward: each large gradient's all-reduce is posted as soon as autograd
has finished accumulating it, while backward goes on with the layers below (what DDP does for data
parallelism, here for the sp x dp sum of `seqpar.loss.sum_gradients`).

The sums are the same collectives on the same tensors as `sum_gradients` (large contiguous gradients in
place, small ones coalesced into one buffer at the end), so the result is bitwise the same; only the
time they are posted moves. Every rank must post the same collectives in the same order whatever order
its backward finishes them in (a parameter may get no gradient on one rank, e.g. an MoE expert no local
token chose), so posts follow one fixed order, the reverse of the parameters' order (about the order
backward produces them): a gradient is posted once it and every gradient before it in that order is
ready; `finish` posts what is left (zeros for gradients that never came) and waits for all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh

__all__ = ["OverlappedGradSum", "fill_missing_grads"]


def fill_missing_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """A zero gradient for every parameter backward left without one, so every rank sums the same tensors."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


class OverlappedGradSum:
    """Sums the gradients of `params` over the mesh's sp x dp ranks, posting the sp sums during backward.

    Use: `arm()` before the step's last backward (earlier micro-batches only accumulate), then `finish()`
    after it; `disarm()` on an error path. The first of (sp, dp) with more than one rank is overlapped, the
    other (when both are) is summed in `finish`, as `sum_gradients` does. Not for FSDP (it reduces its own
    shards) or fp32 master copies (their gradients exist only after backward).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], mesh: SequenceParallelMesh) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.device = mesh.comm_device
        groups = [g for g in (mesh.sp_group, mesh.dp_group) if comm.group_size(g) > 1]
        self.group, self.after = (groups[0], groups[1:]) if groups else (None, [])
        self.order = self.params[::-1]  # about the order backward produces them
        self.slot = {id(p): i for i, p in enumerate(self.order)}
        self.posted_in_backward = 0  # of the last step: how much overlapped (tests, benchmarks)
        self._armed, self._ready, self._next, self._works = False, [False] * len(self.order), 0, []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params] if groups else []

    def arm(self) -> None:
        self._armed, self._ready, self._next, self._works = True, [False] * len(self.order), 0, []

    def disarm(self) -> None:
        self._armed = False

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._armed:
            i = self.slot[id(p)]
            if i < self._next:  # its sum is in flight: accumulating again would race with it
                raise SeqParError(
                    f"a gradient of shape {tuple(p.shape)} was accumulated again after its all-reduce was posted: "
                    "arm() only right before the step's last backward, and run that backward once")
            self._ready[i] = True
            self._advance()

    def _advance(self) -> None:
        """Post, in the fixed order, every gradient whose turn has come and that is ready."""
        while self._next < len(self.order) and self._ready[self._next]:
            p = self.order[self._next]
            if comm.in_place_reducible(p):
                if not p.grad.is_contiguous():  # layouts follow the parameter's; guard the in-place sum
                    p.grad = p.grad.contiguous()
                self._works.append(comm.all_reduce_async_(p.grad, self.group, device=self.device))
            self._next += 1

    def finish(self) -> None:
        """Post what backward did not (zeros for gradients that never came), wait, sum the small ones."""
        self.disarm()
        if self.group is None:
            return
        self.posted_in_backward = len(self._works)
        fill_missing_grads(self.params)
        self._ready = [True] * len(self.order)
        self._advance()
        for w in self._works:
            w.wait()
        self._works = []
        small = [p.grad for p in self.params if not comm.in_place_reducible(p)]
        comm.all_reduce_many_(small, self.group, device=self.device)
        for g in self.after:
            comm.all_reduce_many_([p.grad for p in self.params], g, device=self.device)
