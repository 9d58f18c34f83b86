"""Full-sequence helpers of the data path: where packed documents start, their cu_seqlens, and labels shifted
on the FULL sequence (never across a document boundary) -- all computed before any sharding."""

from __future__ import annotations

import torch

__all__ = ["document_starts", "cu_seqlens_from_position_ids", "shift_labels_full"]


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool [S]: True where a document starts (index 0, and wherever pos != previous pos + 1)."""
    pos = torch.as_tensor(position_ids).long().reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    if pos.numel() > 1:
        starts[1:] = pos[1:] != pos[:-1] + 1
    return starts


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 [n_docs + 1] document boundaries of one FULL (unsharded) packed sequence."""
    pos = torch.as_tensor(position_ids).reshape(-1)
    starts = torch.nonzero(document_starts(pos)).reshape(-1)
    return torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)


def shift_labels_full(labels: torch.Tensor, position_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Target of each token of a FULL sequence: the next token's label inside the same document.

    The last token of the sequence and of every document gets `ignore_index` (nothing to predict
    across a document boundary).
    """
    labels = torch.as_tensor(labels).long().reshape(-1)
    out = torch.full_like(labels, ignore_index)
    if labels.numel() > 1:
        out[:-1] = labels[1:]
        out[:-1][document_starts(position_ids)[1:]] = ignore_index
    return out
