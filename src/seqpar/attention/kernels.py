"""Local attention kernels behind one interface: forward -> (out, lse), and a matching backward.

Layout everywhere in seqpar: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] with Hq % Hkv == 0 (GQA: q head j
uses kv head j // (Hq // Hkv)); out [B, Sq, Hq, D] in the input dtype; lse [B, Sq, Hq] in the
accumulation dtype (float32, or float64 for float64 inputs). `causal` is top-left aligned and is
only ever used with Sq == Sk by seqpar's callers. No kernel is ever called with a fully-masked row.

A kernel with `varlen = True` also runs several sequences in one call (`varlen_forward` /
`varlen_backward`): q [T, Hq, D], k/v [Tk, Hkv, D] packed back to back, sequence i being rows
cu_q[i]:cu_q[i+1] of q against rows cu_k[i]:cu_k[i+1] of k/v (cu_* are Python tuples of ints); out
[T, Hq, D], lse [T, Hq]. Callers use that form only to run several pieces at once (attention.pieces).

- "cpu": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu (+ _backward). CI-tested.
- "math": plain matmul/softmax in the accumulation dtype; any device and dtype. CI-tested.
- "flash", "cudnn", "efficient": torch's CUDA SDPA ops (attention.cuda_kernels, imported lazily); their
  argument plumbing is CI-tested on meta tensors against the CUDA ops' rules, the logic around their calls on
  float64 emulations of the ops (every SP mode), their numerics on a GPU (`make test-gpu`). Which one 'auto'
  picks (torch's own rules per release, for training or not): attention.kernel_choice.
A banded call (a sliding window's partly visible rectangle, attention.pieces) passes `band=(lo, hi)`: q row a
sees key c iff lo <= a - c <= hi, with `causal` False. "cpu" takes it as an additive mask, "math" as a boolean one,
"flash" as FlashAttention's window (cuda_kernels). A kernel object without the `band` keyword is refused for
windowed attention (attention.calls).
`VarlenByLoop` gives any kernel a varlen form by looping over the sequences (CPU tests of the varlen
call paths; the same results as the pieces one by one).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .kernel_choice import resolve_kernel_name
from .kernel_utils import Band, acc_dtype, band_bias, default_scale
from .kernel_utils import bhsd as _bhsd
from .math_kernel import MathKernel

__all__ = [
    "AttentionKernel",
    "CpuFlashKernel",
    "MathKernel",
    "VarlenByLoop",
    "CudaWorkspaceOnCpu",
    "attention_forward_ops",
    "get_kernel",
    "acc_dtype",
    "default_scale",
]


class AttentionKernel(Protocol):
    name: str
    varlen: bool

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, band: Band | None = None
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
        band: Band | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class CpuFlashKernel:
    """The CPU flash-attention op. Handles GQA natively; lse comes back float32 (float64 for float64)."""

    name = "cpu"
    varlen = False

    def forward(self, q, k, v, causal, scale, band=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, attn_mask=_cpu_mask(q, k, band), scale=scale
        )
        return _bhsd(out), _bhsd(lse)

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout.to(q.dtype)),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out.to(q.dtype)),
            _bhsd(lse.to(acc_dtype(q.dtype))),
            0.0,
            causal,
            attn_mask=_cpu_mask(q, k, band),
            scale=scale,
        )
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _cpu_mask(q: torch.Tensor, k: torch.Tensor, band: Band | None) -> torch.Tensor | None:
    """The CPU op's additive mask for a banded call (it takes a mask in q's dtype, not a bool one)."""
    return None if band is None else band_bias(q.shape[1], k.shape[1], band, q.dtype, q.device)


class VarlenByLoop:
    """A dense kernel with a varlen form made of one dense call per sequence: exact (each sequence is what the
    dense kernel gives it), no faster. It lets CPU tests run every varlen call path that CUDA's flash kernel
    takes (gathered rows, the [T, H] lse, per-sequence gradients scattered back)."""

    varlen = True

    def __init__(self, inner: AttentionKernel):
        self.inner = inner
        self.name = f"{inner.name}+varlen_loop"

    def forward(self, q, k, v, causal, scale, band=None):
        extra = () if band is None else (band,)  # an inner kernel without `band` still runs unwindowed calls
        return self.inner.forward(q, k, v, causal, scale, *extra)

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        extra = () if band is None else (band,)
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale, *extra)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        outs, lses = [], []
        for i in range(len(cu_q) - 1):
            sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            o, lse = self.inner.forward(q[None, sq], k[None, sk], v[None, sk], causal, scale)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses)

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for i in range(len(cu_q) - 1):
            sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            g = self.inner.backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], out[None, sq],
                                    lse[None, sq], causal, scale)
            dq[sq], dk[sk], dv[sk] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


class CudaWorkspaceOnCpu(CpuFlashKernel):
    """The CPU kernel, holding during each backward call what CUDA's flash / cuDNN backward allocates inside
    theirs (an fp32 dQ accumulator, fp32 softmax statistics and, with GQA, dK / dV at the q heads): the exact
    CPU meter then measures the CUDA memory of the real training step, so `seqpar plan --validate`'s rows
    marked cuda check the planner's CUDA terms (planner.tiled.cuda_attention_workspace) against the code
    paths that allocate them, without a GPU. Same numerics as "cpu"."""

    name = "cpu_cuda_workspace"

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        b, s, hq, d = q.shape
        ws = [q.new_empty((b, s, hq, d), dtype=torch.float32), q.new_empty((b, hq, s), dtype=torch.float32)]
        if k.shape[2] < hq:
            ws += [q.new_empty((b, k.shape[1], hq, d)), q.new_empty((b, k.shape[1], hq, d))]
        grads = super().backward(dout, q, k, v, out, lse, causal, scale, band)
        del ws  # freed when the call returns, as the CUDA kernels' workspace
        return grads


def attention_forward_ops() -> frozenset:
    """The torch ops whose outputs are an attention kernel call's forward result (every kernel but math):
    memory.checkpointing keeps them through a checkpoint instead of recomputing them (keep_attention)."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_flash_attention_forward", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_efficient_attention")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def get_kernel(device: torch.device, name: str | AttentionKernel = "auto", dtype: torch.dtype | None = None,
               head_dim: int | None = None, training: bool = True) -> AttentionKernel:
    """The kernel for `name` ('auto', a kernel name, or an AttentionKernel instance, used as is).

    'auto' and the refusals (a kernel that cannot take this device, dtype or head_dim raises SeqParError
    before any communication: the check needs no data) are kernel_choice.resolve_kernel_name's.
    """
    if not isinstance(name, str):
        return name
    name = resolve_kernel_name(device, name, dtype, head_dim, training)
    if name == "cpu":
        return CpuFlashKernel()
    if name == "cpu_cuda_workspace":
        return CudaWorkspaceOnCpu()
    if name == "math":
        return MathKernel()
    # GPU-only, imported lazily: nothing on the CPU path loads cuda_kernels.
    from .cuda_kernels import CUDA_KERNELS

    return CUDA_KERNELS[name]()
