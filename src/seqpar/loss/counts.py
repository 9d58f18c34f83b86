"""The global counts and sums every seqpar loss is normalised by or reduced with: the step's supervised-token
(or pair) count over dp, the wrapper's gradient factor, the gradient SUM over dp x sp, and the logged loss value
(see the gradient convention in the `seqpar.loss` docstring).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import comm
from ..mesh import SequenceParallelMesh
from .grad_sync import fill_missing_grads
from .nll import upcast

__all__ = ["global_token_count", "gradient_reduction_factor", "sum_gradients", "global_loss"]


def global_token_count(local_count: torch.Tensor | int, mesh: SequenceParallelMesh | None) -> torch.Tensor:
    """Sum a FULL-batch count over dp (SP ranks of a group share the same count, so not over sp).

    `local_count` is what the collator reports for this dp rank (e.g. "num_supervised_tokens"),
    summed over all grad-accumulation micro-batches of the step. Returns a new long tensor, the
    same on every rank: the denominator for `sft_loss`. On a CUDA (NCCL) mesh it lives on the
    current CUDA device, elsewhere where `local_count` was.
    """
    t = torch.as_tensor(local_count).detach().clone().long()
    if mesh is not None and mesh.dp_size > 1:
        t = t.to(mesh.comm_device)
        comm.all_reduce_(t, mesh.dp_group, device=mesh.comm_device)
    return t


def gradient_reduction_factor(mesh: SequenceParallelMesh | None) -> float:
    """Multiply each loss share by this when the wrapper AVERAGES gradients over dp x sp (DDP, FSDP).

    Our shares need a SUM of gradients over all dp * sp ranks; an average divides by dp * sp.
    """
    return 1.0 if mesh is None else float(mesh.dp_size * mesh.sp_size)


@torch.no_grad()
def sum_gradients(parameters: Iterable[torch.nn.Parameter], mesh: SequenceParallelMesh | None) -> None:
    """SUM .grad of replicated parameters over sp, then dp (i.e. over the whole world), in place.

    Parameters without a gradient get a zero one, so every rank issues the same collectives.
    Large gradients are reduced in place, small ones through one buffer (`seqpar.comm.all_reduce_many_`).
    """
    params = [p for p in parameters if p.requires_grad]
    if mesh is None or mesh.world_size == 1:
        return
    fill_missing_grads(params)
    for group in (mesh.sp_group, mesh.dp_group):
        comm.all_reduce_many_([p.grad for p in params], group, device=mesh.comm_device)


def global_loss(loss_share: torch.Tensor, mesh: SequenceParallelMesh | None) -> torch.Tensor:
    """The true loss value (for logging): the detached sum of every rank's share over sp x dp."""
    t = upcast(loss_share.detach().clone())
    if mesh is not None and mesh.world_size > 1:
        t = t.to(mesh.comm_device)
        comm.all_reduce_(t, mesh.sp_group, device=mesh.comm_device)
        comm.all_reduce_(t, mesh.dp_group, device=mesh.comm_device)
    return t

