"""Mamba1's selective scan on one piece, with what state passing needs.

Per channel d and state entry n (B_t, C_t shared by the channels):
    dt_t = softplus(dt_raw_t + dt_bias),   h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t,
    y_t = (h_t . C_t + D x_t) * silu(z_t).
The decay is one scalar per (channel, state entry) and step, so with c_t = sum_{tau <= t} dt_tau A [d, n]:
    h_L = exp(c_L) h_0 + (h_L from h_0 = 0),     y_t(h_0) = y_t(0) + silu(z_t) * sum_n exp(c_t) h_0 C_t.
M = exp(c_L), shaped as the state ("diagonal" transition). The scan itself is the model's own function
(transformers' `mamba_selective_scan` torch path, or mamba_ssm's `selective_scan_fn` with the same signature),
called from a zero state (neither takes an initial state on every path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .engine import PieceResult

__all__ = ["SelectiveParams", "selective_piece"]


@dataclass(frozen=True)
class SelectiveParams:
    a: torch.Tensor  # [d, n] A = -exp(A_log) (fp32)
    d: torch.Tensor  # [d] skip (fp32)
    dt_bias: torch.Tensor | None  # [d] (fp32)
    scan_kwargs: dict = field(default_factory=dict)  # what else the layer passes its scan (use_mambapy, ...)


def selective_piece(scan: Callable, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    z: torch.Tensor, prm: SelectiveParams, carries: bool) -> PieceResult:
    """x, dt, z [bs, L, d] (dt before bias / softplus); b, c [bs, L, n]. `scan` is called as scan(x, dt, A, B, C,
    D=, z=, delta_bias=, delta_softplus=True, return_last_state=True) with channels first ([bs, d, L])."""
    t = (lambda v: v.transpose(1, 2))
    y, final = scan(t(x), t(dt), prm.a, t(b), t(c), D=prm.d, z=t(z), delta_bias=prm.dt_bias, delta_softplus=True,
                    return_last_state=True, **prm.scan_kwargs)
    y = t(y)
    if not carries:
        return PieceResult(y, final)
    acc = final.dtype
    raw = dt.to(acc) + (prm.dt_bias.to(acc) if prm.dt_bias is not None else 0)
    cum = torch.cumsum(F.softplus(raw)[..., None] * prm.a.to(acc), dim=1)  # [bs, L, d, n]
    through = cum[:, -1].exp()  # M: [bs, d, n]
    gate = F.silu(z.to(acc))

    def correct(s_in: torch.Tensor) -> torch.Tensor:  # s_in [bs, d, n]
        return torch.einsum("bln,bldn,bdn->bld", c.to(acc), cum.exp(), s_in) * gate

    return PieceResult(y, final, through, correct)
