"""Small tensor helpers shared by every local attention kernel (CPU, math and the GPU-only ones).

Kept in their own module so `kernels.py` and `cuda_kernels.py` both import from here and never from
each other (no import cycle; `kernels.get_kernel` imports `cuda_kernels` lazily, one way only).
"""

from __future__ import annotations

import math

import torch

__all__ = ["acc_dtype", "bhsd", "repeat_kv", "fold_kv_grad", "default_scale", "one_key_forward", "one_key_backward"]


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


def one_key_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a single key (a 1-token document's piece): softmax over one score is 1, so out = v and
    lse = the score. For kernels that refuse a 1-key call (cuDNN)."""
    groups = q.shape[2] // k.shape[2]
    kk = repeat_kv(k, groups)
    lse = (q.to(acc_dtype(q.dtype)) * kk.to(acc_dtype(q.dtype))).sum(-1) * scale
    return repeat_kv(v, groups).expand(q.shape).to(q.dtype).contiguous(), lse


def one_key_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of a 1-key piece from the row's FINAL out / lse, as a fused kernel's backward computes it: inside
    a ring or USP merge this key is one term of a larger softmax, so its weight p = exp(s - lse) is not 1 and dq, dk
    are not 0. p = exp(q.k * scale - lse), dv = sum_rows p * dout, dS = p * (dout.v - rowsum(dout * out)),
    dq = dS * scale * k, dk = sum_rows dS * scale * q (GQA: summed over the key's q heads). When the key IS the whole
    softmax (p = 1, out = v) this gives dq = dk = 0 and dv = sum of dout."""
    a = acc_dtype(q.dtype)
    groups = q.shape[2] // k.shape[2]
    q_, do = q.to(a), dout.to(a)
    kk, vv = repeat_kv(k, groups).to(a), repeat_kv(v, groups).to(a)  # [B, 1, Hq, D]
    p = torch.exp((q_ * kk).sum(-1) * scale - lse.to(a))  # [B, S, Hq]
    ds = p * ((do * vv).sum(-1) - (do * out.to(a)).sum(-1))  # [B, S, Hq]
    dq = (ds * scale).unsqueeze(-1) * kk
    dk = fold_kv_grad(((ds * scale).unsqueeze(-1) * q_).sum(1, keepdim=True), groups)
    dv = fold_kv_grad((p.unsqueeze(-1) * do).sum(1, keepdim=True), groups)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
