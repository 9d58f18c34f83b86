"""Local attention kernels behind one interface: forward -> (out, lse), and a matching backward.

Layout everywhere in seqpar: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] with Hq % Hkv == 0 (GQA: q head j
uses kv head j // (Hq // Hkv)); out [B, Sq, Hq, D] in the input dtype; lse [B, Sq, Hq] in the
accumulation dtype (float32, or float64 for float64 inputs). `causal` is top-left aligned and is
only ever used with Sq == Sk by seqpar's callers. No kernel is ever called with a fully-masked row.

- "cpu": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward). CI-tested.
- "math": plain matmul/softmax in the accumulation dtype; any device and dtype. CI-tested.
- "cuda": torch's CUDA flash SDPA ops, fp16/bf16 only. GPU-only, NOT CI-tested; imported lazily.
- "cuda_efficient": torch's CUDA memory-efficient SDPA ops (fp32, fp16, bf16). GPU-only, NOT CI-tested.
'auto' routes by (device type, dtype): see `kernel_name_for` (CI-tested as a pure function).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import SeqParError
from .kernel_utils import acc_dtype, default_scale
from .kernel_utils import bhsd as _bhsd
from .kernel_utils import fold_kv_grad as _fold_kv_grad
from .kernel_utils import repeat_kv as _repeat_kv

__all__ = [
    "AttentionKernel",
    "CpuFlashKernel",
    "MathKernel",
    "KERNEL_NAMES",
    "kernel_name_for",
    "get_kernel",
    "acc_dtype",
    "default_scale",
]


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


# dtypes each kernel accepts (None: any floating dtype). torch's CUDA flash op takes half precision only;
# its memory-efficient op also takes fp32 but not fp64 (fp64 on CUDA goes to the math kernel).
_KERNEL_DTYPES: dict[str, tuple[torch.dtype, ...] | None] = {
    "cpu": None,
    "math": None,
    "cuda": (torch.float16, torch.bfloat16),
    "cuda_efficient": (torch.float32, torch.float16, torch.bfloat16),
}
KERNEL_NAMES = tuple(_KERNEL_DTYPES)


def kernel_name_for(device_type: str, dtype: torch.dtype) -> str:
    """What 'auto' picks for a (device type, dtype): a pure function, so the routing is testable without a GPU.

    cpu -> 'cpu' (every dtype); cuda -> 'cuda' (flash) for fp16/bf16, 'cuda_efficient' for fp32,
    'math' for anything else (fp64); other devices -> 'math'.
    """
    if device_type == "cpu":
        return "cpu"
    if device_type == "cuda":
        for name in ("cuda", "cuda_efficient"):
            if dtype in _KERNEL_DTYPES[name]:
                return name
    return "math"


def get_kernel(device: torch.device, name: str = "auto", dtype: torch.dtype | None = None) -> AttentionKernel:
    """Pick a kernel by name; 'auto' routes by (device type, dtype) with `kernel_name_for`.

    Without `dtype`, 'auto' assumes half precision on CUDA. With `dtype`, an explicit name that
    cannot take it raises SeqParError (before any communication: the check needs no data).
    """
    if name == "auto":
        name = kernel_name_for(device.type, dtype if dtype is not None else torch.bfloat16)
    if name not in _KERNEL_DTYPES:
        raise ValueError(f"unknown attention kernel {name!r}: use 'auto' or one of {KERNEL_NAMES}")
    ok = _KERNEL_DTYPES[name]
    if dtype is not None and ok is not None and dtype not in ok:
        raise SeqParError(
            f"attention kernel {name!r} does not support {dtype} (it takes {', '.join(map(str, ok))}): "
            f"use kernel='auto' (picks {kernel_name_for(device.type, dtype)!r} here) or 'math'"
        )
    if name == "cpu":
        return CpuFlashKernel()
    if name == "math":
        return MathKernel()
    # GPU-only, imported lazily: nothing on the CPU path loads cuda_kernels.
    from .cuda_kernels import CudaEfficientKernel, CudaSdpaKernel

    return CudaSdpaKernel() if name == "cuda" else CudaEfficientKernel()
