"""What every part of the attention benchmark shares: the random q/k/v of one problem, the pass names, a ratio."""

from __future__ import annotations

import torch

__all__ = ["FWD_BWD", "qkv", "ratio"]

FWD_BWD = ("fwd", "bwd")


def qkv(seq: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, seq, hq, d, generator=g).to(dtype),
        torch.randn(1, seq, hkv, d, generator=g).to(dtype),
        torch.randn(1, seq, hkv, d, generator=g).to(dtype),
    )


def ratio(a: float, b: float) -> float | None:
    return None if b == 0 else a / b
