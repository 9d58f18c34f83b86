"""Numerically stable log-sum-exp merge of partial attention results."""

from __future__ import annotations

import torch

__all__ = ["merge_"]


def merge_(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """In place: (out, lse) <- softmax-weighted union of (out, lse) and (out_blk, lse_blk).

    out [..., D] and lse [...] are the fp32/fp64 accumulators; lse = -inf marks "nothing seen yet".
    out' = out - sigmoid(lse_blk - lse) * (out - out_blk);  lse' = lse - logsigmoid(lse - lse_blk).
    Equal to the logaddexp form without ever exponentiating a large number. Rows where the
    accumulator is still empty take the block as is; rows where the block is empty keep theirs.
    """
    out_blk = out_blk.to(out.dtype)
    lse_blk = lse_blk.to(lse.dtype)
    empty = torch.isneginf(lse)
    blk_empty = torch.isneginf(lse_blk)
    # Substitute finite dummies where -inf would produce inf - inf; those rows are fixed by `where`.
    safe_lse = torch.where(empty, torch.zeros_like(lse), lse)
    safe_blk = torch.where(blk_empty, torch.zeros_like(lse_blk), lse_blk)
    w = torch.sigmoid(safe_blk - safe_lse).unsqueeze(-1)
    new_out = out - w * (out - out_blk)
    new_lse = safe_lse - torch.nn.functional.logsigmoid(safe_lse - safe_blk)
    take_blk = (empty & ~blk_empty).unsqueeze(-1)
    keep = blk_empty.unsqueeze(-1)
    out.copy_(torch.where(take_blk, out_blk, torch.where(keep, out, new_out)))
    lse.copy_(torch.where(empty & ~blk_empty, lse_blk, torch.where(blk_empty, lse, new_lse)))
