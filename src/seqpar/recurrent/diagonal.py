"""A diagonal linear recurrence (RecurrentGemma's RG-LRU) on one piece, with what state passing needs.

Per channel c, with a decay a_t = exp(log_a_t) and an input x_t (both per token and channel):
    h_t = a_t h_{t-1} + x_t,     y_t = h_t.
So with c_t = sum_{tau <= t} log_a_tau (t counted from the piece's start):
    h_L = exp(c_L) h_0 + (h_L from h_0 = 0),     y_t(h_0) = y_t(0) + exp(c_t) h_0.
M = exp(c_L), shaped as the state ("diagonal" transition). The scan itself is the model's own function, called from
a zero state. A reset token (a_t = 0: RecurrentGemma's position 0) has log_a_t = -inf: exp(c_t) = 0 from there on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .engine import PieceResult

__all__ = ["diagonal_piece"]


def diagonal_piece(scan: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                   log_a: torch.Tensor, carries: bool) -> PieceResult:
    """x, log_a [b, L, C] (-inf where a_t = 0); scan(x, log_a) -> (y [b, L, C], final state [b, C] in fp32 / fp64)
    from a zero state."""
    y, final = scan(x, log_a)
    if not carries:
        return PieceResult(y, final)
    cum = torch.cumsum(log_a.to(final.dtype), dim=1)  # [b, L, C]

    def correct(s_in: torch.Tensor) -> torch.Tensor:  # s_in [b, C]
        return cum.exp() * s_in[:, None]

    return PieceResult(y, final, cum[:, -1].exp(), correct)
