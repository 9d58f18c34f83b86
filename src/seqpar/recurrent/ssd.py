"""Mamba2's SSD scan on one piece, with what state passing needs.

Per head h (head dim p, state size n, B_t / C_t from the head's group):
    dt_t = clamp(softplus(dt_raw_t + dt_bias), limits),   h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
    y_t = h_t C_t + D x_t.
The decay is one scalar per head and step, so with c_t = sum_{tau <= t} dt_tau A:
    h_L = exp(c_L) h_0 + (h_L from h_0 = 0),     y_t(h_0) = y_t(0) + exp(c_t) h_0 C_t.
M = exp(c_L) per head ("scalar" transition). The scan itself is the model's own function (transformers'
`mamba2_chunk_scan` torch path, or the mamba_ssm hub kernel with the same signature), called from a zero state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .engine import PieceResult

__all__ = ["SSDParams", "ssd_piece"]


@dataclass(frozen=True)
class SSDParams:
    a: torch.Tensor  # [h] A = -exp(A_log) (fp32)
    d: torch.Tensor | None  # [h] skip
    dt_bias: torch.Tensor  # [h]
    dt_limit: tuple[float, float]
    chunk_size: int


def ssd_piece(scan: Callable, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              prm: SSDParams, carries: bool) -> PieceResult:
    """x [bs, L, h, p]; dt [bs, L, h] (before bias / softplus); b, c [bs, L, g, n]. `scan` is called as
    scan(x, dt, A, B, C, chunk_size=, D=, dt_bias=, dt_softplus=True, dt_limit=, return_final_states=True)."""
    y, final = scan(x, dt, prm.a, b, c, chunk_size=prm.chunk_size, D=prm.d, dt_bias=prm.dt_bias,
                    dt_softplus=True, dt_limit=prm.dt_limit, return_final_states=True)
    if not carries:
        return PieceResult(y, final)
    acc = final.dtype
    step = torch.clamp(F.softplus(dt + prm.dt_bias.to(dt.dtype)), min=prm.dt_limit[0], max=prm.dt_limit[1])
    cum = torch.cumsum(step.to(acc) * prm.a.to(acc), dim=1)  # [bs, L, h]
    through = cum[:, -1].exp()  # M: [bs, h]
    heads, groups = x.shape[2], c.shape[2]
    c_h = c.to(acc).repeat_interleave(heads // groups, dim=2)  # [bs, L, h, n]

    def correct(s_in: torch.Tensor) -> torch.Tensor:  # s_in [bs, h, p, n]
        return torch.einsum("blhn,bhpn->blhp", c_h, s_in) * cum.exp()[..., None]

    return PieceResult(y, final, through, correct)
