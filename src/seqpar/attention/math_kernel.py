"""The plain-math local kernel: S = QK^T * scale, P = exp(S - lse), in the accumulation dtype, on any device. Its own
module so that both the CPU kernels (attention.kernels) and the CUDA ones (attention.cuda_kernels: banded calls an
op cannot take) use it without importing each other."""

from __future__ import annotations

import torch

from .kernel_utils import acc_dtype, band_mask
from .kernel_utils import bhsd as _bhsd
from .kernel_utils import fold_kv_grad as _fold_kv_grad
from .kernel_utils import repeat_kv as _repeat_kv

__all__ = ["MathKernel"]


class MathKernel:
    """Plain math in the accumulation dtype: S = QK^T*scale, P = exp(S - lse). Any device."""

    name = "math"
    varlen = False

    def _scores(self, q, k, causal, scale, band=None):
        a = acc_dtype(q.dtype)
        groups = q.shape[2] // k.shape[2]
        qh = _bhsd(q).to(a)
        kh = _bhsd(_repeat_kv(k, groups)).to(a)
        s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        if causal:
            sq, sk = s.shape[-2], s.shape[-1]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~mask, float("-inf"))
        if band is not None:
            s = s.masked_fill(~band_mask(s.shape[-2], s.shape[-1], band, s.device), float("-inf"))
        return s, groups

    def forward(self, q, k, v, causal, scale, band=None):
        s, groups = self._scores(q, k, causal, scale, band)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        vh = _bhsd(_repeat_kv(v, groups)).to(s.dtype)
        out = torch.matmul(p, vh)
        return _bhsd(out).to(q.dtype), _bhsd(lse)

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        s, groups = self._scores(q, k, causal, scale, band)
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
