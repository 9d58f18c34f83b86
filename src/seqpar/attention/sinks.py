"""Attention sinks (gpt-oss): a learned logit per q head in every row's softmax denominator, with no value.

A sink is one more term of the row's log-sum-exp: a "key" whose logit is `sink[h]` for every query and whose
value is 0. So it merges like any block's partial result, (out, lse) with (0, sink): out *= exp(lse - lse'),
lse' = logaddexp(lse, sink). Every kernel's backward then runs unchanged on the FINAL out / lse (its
probabilities exp(s - lse') already carry the sink's share of the denominator), and the sink's own gradient is
that of a key with value 0: d sink[h] = -sum over rows of p_sink * rowsum(dout * out), p_sink = exp(sink - lse').
Where the row is split (ring) each rank adds its rows' part; where the heads are split (Ulysses) each rank holds
whole heads: the SP gradient sum over ranks gives the parameter's gradient in both cases.
"""

from __future__ import annotations

import torch

__all__ = ["add_sink_", "sink_grad", "sinks_for_heads", "heads_grad_to_sinks"]


def add_sink_(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """In place: merge the sink into (out [B, S, H, D] accumulator, lse [B, S, H]); `sink` [H] (-inf: none)."""
    s = sink.to(lse.dtype)
    new_lse = torch.logaddexp(lse, s)
    w = torch.exp(lse - new_lse).nan_to_num_(nan=0.0)  # -inf on both sides (a dummy head): keep what is there
    out.mul_(w.unsqueeze(-1).to(out.dtype))
    lse.copy_(new_lse)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """[H] gradient of the sink logits from this rank's rows: -sum_{b, s} exp(sink - lse) * rowsum(dout * out)."""
    a = lse.dtype
    delta = (dout.to(a) * out.to(a)).sum(-1)
    p = torch.exp(sink.to(a) - lse)
    return -(p * delta).sum(dim=(0, 1))


def sinks_for_heads(sinks: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
    """The sink of each local head (an original q head index; -1, a dummy head: -inf, no sink)."""
    idx = torch.tensor([max(h, 0) for h in heads], device=sinks.device, dtype=torch.long)
    picked = sinks.index_select(0, idx)
    dummy = torch.tensor([h < 0 for h in heads], device=sinks.device)
    return picked.masked_fill(dummy, float("-inf"))


def heads_grad_to_sinks(grad: torch.Tensor, heads: tuple[int, ...], num_heads: int) -> torch.Tensor:
    """The [num_heads] gradient of the original sinks from the local heads' gradients (dummy heads dropped)."""
    full = grad.new_zeros(num_heads)
    real = [(j, h) for j, h in enumerate(heads) if h >= 0]
    if real:
        src = torch.tensor([j for j, _ in real], device=grad.device)
        dst = torch.tensor([h for _, h in real], device=grad.device)
        full.index_add_(0, dst, grad.index_select(0, src))
    return full
