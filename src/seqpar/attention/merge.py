"""Numerically stable log-sum-exp merge of partial attention results."""

from __future__ import annotations

import torch

__all__ = ["merge_"]


def merge_(out: torch.Tensor, lse: torch.Tensor, out_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """In place: (out, lse) <- softmax-weighted union of (out, lse) and (out_blk, lse_blk).

    out [..., D] and lse [...] are the fp32/fp64 accumulators; lse = -inf marks "nothing seen yet".
    lse' = logaddexp(lse, lse_blk); out' = lerp(out, out_blk, w) with w = exp(lse_blk - lse') in [0, 1], so
    nothing large is ever exponentiated. One pass over `out` (this runs once per ring step on every layer).
    Rows where the accumulator is still empty get w = 1 (the block as is), rows where the block is empty
    w = 0 (theirs kept); rows empty on both sides give exp(nan), set to w = 0.
    """
    new_lse = torch.logaddexp(lse, lse_blk.to(lse.dtype))
    w = torch.exp(lse_blk.to(lse.dtype) - new_lse).nan_to_num_(nan=0.0).unsqueeze(-1)
    out.lerp_(out_blk.to(out.dtype), w)
    lse.copy_(new_lse)
