"""Local attention kernels behind one interface: forward -> (out, lse), and a matching backward.

Layout everywhere in seqpar: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] with Hq % Hkv == 0 (GQA: q head j
uses kv head j // (Hq // Hkv)); out [B, Sq, Hq, D] in the input dtype; lse [B, Sq, Hq] in the
accumulation dtype (float32, or float64 for float64 inputs). `causal` is top-left aligned and is
only ever used with Sq == Sk by seqpar's callers. No kernel is ever called with a fully-masked row.

- "cpu": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward). CI-tested.
- "math": plain matmul/softmax in the accumulation dtype; any device and dtype. CI-tested.
- "cuda": torch's CUDA flash SDPA ops. GPU-only and NOT CI-tested (no GPU here); imported lazily.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

__all__ = ["AttentionKernel", "CpuFlashKernel", "MathKernel", "get_kernel", "acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class AttentionKernel(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


class CpuFlashKernel:
    """The CPU flash-attention op. Handles GQA natively; lse comes back float32 (float64 for float64)."""

    name = "cpu"

    def forward(self, q, k, v, causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, attn_mask=None, scale=scale
        )
        return _bhsd(out), _bhsd(lse)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout.to(q.dtype)),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out.to(q.dtype)),
            _bhsd(lse.to(acc_dtype(q.dtype))),
            0.0,
            causal,
            attn_mask=None,
            scale=scale,
        )
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _fold_kv_grad(g: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return g
    b, s, h, d = g.shape
    return g.view(b, s, h // groups, groups, d).sum(3)


class MathKernel:
    """Plain math in the accumulation dtype: S = QK^T*scale, P = exp(S - lse). Any device."""

    name = "math"

    def _scores(self, q, k, causal, scale):
        a = acc_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        qh = _bhsd(q).to(a)
        kh = _bhsd(_repeat_kv(k, groups)).to(a)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        if causal:
            sq, sk = s.shape[-2], s.shape[-1]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~mask, float("-inf"))
        return s, groups

    def forward(self, q, k, v, causal, scale):
        s, groups = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        vh = _bhsd(_repeat_kv(v, groups)).to(s.dtype)
        out = torch.matmul(p, vh)
        return _bhsd(out).to(q.dtype), _bhsd(lse)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        s, groups = self._scores(q, k, causal, scale)
        a = s.dtype
        p = torch.exp(s - _bhsd(lse).to(a).unsqueeze(-1))
        do = _bhsd(dout).to(a)
        vh = _bhsd(_repeat_kv(v, groups)).to(a)
        kh = _bhsd(_repeat_kv(k, groups)).to(a)
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, vh.transpose(-1, -2))
        delta = (do * _bhsd(out).to(a)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, kh)
        dk = torch.matmul(ds.transpose(-1, -2), _bhsd(q).to(a))
        return (
            _bhsd(dq).to(q.dtype),
            _fold_kv_grad(_bhsd(dk), groups).to(k.dtype),
            _fold_kv_grad(_bhsd(dv), groups).to(v.dtype),
        )


def get_kernel(device: torch.device, name: str = "auto") -> AttentionKernel:
    """Pick a kernel: 'auto' -> 'cpu' on CPU, 'cuda' on CUDA, 'math' elsewhere."""
    if name == "auto":
        name = {"cpu": "cpu", "cuda": "cuda"}.get(device.type, "math")
    if name == "cpu":
        return CpuFlashKernel()
    if name == "math":
        return MathKernel()
    if name == "cuda":
        from .cuda_kernels import CudaSdpaKernel  # GPU-only, not imported on the CPU path

        return CudaSdpaKernel()
    raise ValueError(f"unknown attention kernel {name!r}: use 'auto', 'cpu', 'math' or 'cuda'")


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
