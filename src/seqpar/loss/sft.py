"""SFT: this rank's share of the step's token-mean cross-entropy, from full logits or the chunked head."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .counts import global_loss
from .nll import IGNORE_INDEX, check_inputs, per_token_nll

__all__ = ["sft_loss", "sft_loss_from_nll"]


def sft_loss(
    logits: torch.Tensor | None,
    shift_labels: torch.Tensor,
    num_items: torch.Tensor | int | None,
    *,
    hidden: torch.Tensor | None = None,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk_size: int = 1024,
    mesh: SequenceParallelMesh | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """This rank's share of the token-mean cross-entropy: sum of CE over local tokens / num_items.

    logits: [B, S_local, V] for this rank's shard, or None with hidden=[B, S_local, H] and lm_head
    (chunked CE, `chunk_size` supervised tokens per chunk, full logits never materialised).
    shift_labels: the collator's [B, S_local] targets (ignore_index = not supervised).
    num_items: the GLOBAL supervised-token count of the optimizer step: the collator's
    "num_supervised_tokens" summed over every grad-accumulation micro-batch, then over dp with
    `global_token_count` (SP ranks share it). None: use this micro-batch only, counted over sp x dp
    from shift_labels (needs mesh; one extra all-reduce).
    Zero supervised tokens (on this rank or anywhere) give a finite 0 and zero gradients.
    Gradients: SUM over dp x sp ranks (see the module docstring and `gradient_reduction_factor`).
    """
    check_inputs(logits, hidden, lm_head, shift_labels)
    nll = per_token_nll(logits, shift_labels, hidden, lm_head, chunk_size, ignore_index)
    return sft_loss_from_nll(nll, shift_labels, num_items, mesh=mesh, ignore_index=ignore_index)


def sft_loss_from_nll(
    nll: torch.Tensor,
    shift_labels: torch.Tensor,
    num_items: torch.Tensor | int | None,
    *,
    mesh: SequenceParallelMesh | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """`sft_loss` from a per-token NLL [B, S_local] (0 where not supervised), e.g. the fused head's."""
    if num_items is None:
        if mesh is None:
            raise SeqParError("num_items=None needs mesh= to count supervised tokens over sp x dp")
        local = (shift_labels.to(nll.device) != ignore_index).sum()
        num_items = global_loss(local, mesh)  # sum over sp and dp
    denom = torch.as_tensor(num_items, device=nll.device).detach().to(nll.dtype).clamp(min=1.0)
    return nll.sum() / denom

