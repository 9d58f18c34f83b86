"""MiniMax's lightning attention (linear attention with a constant decay per head) on one piece, with what state
passing needs.

Per head, with lambda = exp(-slope), state S [d, d]:   S_t = lambda S_{t-1} + k_t v_t^T,   o_t = q_t S_t.
So S_L = lambda^L S_0 + (S_L from S_0 = 0) and o_t(S_0) = o_t(0) + lambda^(t+1) q_t S_0 (t counted from the piece's
start): M = lambda^L per head ("scalar" transition). The piece from a zero state runs the block algorithm of
transformers' `MiniMaxLightningAttention.forward` (blocks of `block` tokens: the decayed q k^T v inside a block, the
carried state across blocks), which the layer inlines (there is no kernel function to call).
"""

from __future__ import annotations

import torch

from .engine import PieceResult

__all__ = ["lightning_piece"]


def lightning_piece(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, block: int,
                    carries: bool) -> PieceResult:
    """q, k, v [b, L, h, d]; slope [h] (lambda = exp(-slope)). States in fp32 (fp64 for fp64)."""
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    qh, kh, vh = (t.transpose(1, 2).to(acc) for t in (q, k, v))  # [b, h, L, d]
    b, h, length, d = qh.shape
    lam = slope.to(acc).reshape(h, 1, 1)
    state = qh.new_zeros(b, h, d, d)
    outs = []
    for lo in range(0, length, block):
        n = min(block, length - lo)
        qb, kb, vb = (t[:, :, lo : lo + n] for t in (qh, kh, vh))
        r = torch.arange(1, n + 1, device=qh.device, dtype=acc)
        diag = r[:, None] - r[None, :]
        diag = torch.exp(torch.where(diag >= 0, -lam * diag, float("-inf")))  # lambda^(t-s), s <= t
        outs.append((qb @ kb.transpose(-1, -2) * diag) @ vb + (qb * torch.exp(-lam * r[:, None])) @ state)
        state = state * torch.exp(-lam * n) + (kb * torch.exp(-lam * (n - r)[:, None])).transpose(-1, -2) @ vb
    y = torch.cat(outs, dim=2).transpose(1, 2).to(v.dtype)  # [b, L, h, d]
    if not carries:
        return PieceResult(y, state)
    t1 = torch.arange(1, length + 1, device=qh.device, dtype=acc)
    q_in = qh * torch.exp(-lam * t1[:, None])  # lambda^(t+1) q_t
    through = torch.exp(-slope.to(acc) * length).expand(b, h)

    def correct(s_in: torch.Tensor) -> torch.Tensor:  # s_in [b, h, d, d]
        return (q_in @ s_in).transpose(1, 2)

    return PieceResult(y, state, through, correct)
