"""Small tensor helpers shared by every local attention kernel (CPU, math and the GPU-only ones).

Kept in their own module so `kernels.py` and `cuda_kernels.py` both import from here and never from
each other (no import cycle; `kernels.get_kernel` imports `cuda_kernels` lazily, one way only).
"""

from __future__ import annotations

import math

import torch

__all__ = ["acc_dtype", "bhsd", "repeat_kv", "fold_kv_grad", "default_scale", "Band", "band_mask", "band_bias"]

# A banded piece's mask in its own coordinates: q row a sees key c iff lo <= a - c <= hi (attention.pieces: what a
# sliding window leaves of a rectangle). None = no band (the piece is fully visible or an exact causal diagonal).
Band = tuple[int, int]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax / lse accumulation dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bhsd(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] <-> [B, H, S, D] (also [B, S, H] <-> [B, H, S]): seqpar's layout vs torch SDPA's."""
    return x.transpose(1, 2)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Expand KV heads for kernels that need as many KV heads as query heads (GQA)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def fold_kv_grad(g: torch.Tensor, groups: int) -> torch.Tensor:
    """Adjoint of repeat_kv: sum the gradients of the copies of each KV head."""
    if groups == 1:
        return g
    b, s, h, d = g.shape
    return g.view(b, s, h // groups, groups, d).sum(3)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def band_mask(sq: int, sk: int, band: Band, device: torch.device | str = "cpu") -> torch.Tensor:
    """[sq, sk] bool: True where q row a sees key c (lo <= a - c <= hi)."""
    d = torch.arange(sq, device=device)[:, None] - torch.arange(sk, device=device)[None, :]
    return (d >= band[0]) & (d <= band[1])


def band_bias(sq: int, sk: int, band: Band, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """[sq, sk] additive mask in `dtype` (0 where visible, -inf elsewhere): what the CPU flash op takes."""
    bias = torch.zeros((sq, sk), dtype=dtype, device=device)
    return bias.masked_fill_(~band_mask(sq, sk, band, device), float("-inf"))
