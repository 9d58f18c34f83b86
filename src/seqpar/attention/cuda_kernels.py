"""GPU-only local kernels. NOT run in CI: the project's machines have no GPU.

Kept deliberately thin: they map seqpar's kernel interface onto torch's CUDA SDPA ops, which return
the log-sum-exp the ring merge needs. Which one runs is decided by `kernels.kernel_name_for`:
- `CudaSdpaKernel` ("cuda"): the flash op, fp16/bf16 only;
- `CudaEfficientKernel` ("cuda_efficient"): the memory-efficient op, which also takes fp32
  (seqpar's default precision); it pads its lse to a multiple of 32 along the sequence.
What CI does check on CPU (tests/test_kernels_merge.py): the routing decision, that nothing on the
CPU path imports this module, and these wrappers' argument plumbing and shapes on the 'meta'
device (torch's meta implementations of the same ops). Numerics need a GPU:
tests/test_kernels_merge.py::test_cuda_kernels_forward_backward compares both kernels with a float64
reference and is skipped when CUDA is not available (always, in CI).
"""

from __future__ import annotations

import torch

from .kernel_utils import bhsd, fold_kv_grad, repeat_kv

__all__ = ["CudaSdpaKernel", "CudaEfficientKernel"]

_LSE_ALIGN = 32  # the memory-efficient op's lse is [B, H, ceil(Sq / 32) * 32]


class CudaSdpaKernel:
    name = "cuda"

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[2] // k.shape[2]
        # The flash op wants equal head counts: expand KV for GQA (gradients are folded back below).
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            bhsd(q), bhsd(repeat_kv(k, groups)), bhsd(repeat_kv(v, groups)), 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]
        return bhsd(out), bhsd(lse.float())

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[2] // k.shape[2]
        sq, sk = q.shape[1], k.shape[1]
        kk, vv = repeat_kv(k, groups), repeat_kv(v, groups)
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            bhsd(dout.to(q.dtype)).contiguous(),
            bhsd(q),
            bhsd(kk),
            bhsd(vv),
            bhsd(out.to(q.dtype)),
            bhsd(lse).float().contiguous(),
            empty,
            empty,
            sq,
            sk,
            0.0,
            causal,
            empty,
            empty,
            scale=scale,
        )
        return bhsd(dq), fold_kv_grad(bhsd(dk), groups), fold_kv_grad(bhsd(dv), groups)


class CudaEfficientKernel:
    name = "cuda_efficient"

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[2] // k.shape[2]
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            bhsd(q), bhsd(repeat_kv(k, groups)), bhsd(repeat_kv(v, groups)), None, True, 0.0, causal, scale=scale
        )
        return bhsd(out), bhsd(lse[..., : q.shape[1]].float())

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[2] // k.shape[2]
        kk, vv = repeat_kv(k, groups), repeat_kv(v, groups)
        # Give the op its lse in the padded layout it produced; padded rows hold +inf (probability 0).
        lse_h = bhsd(lse).float()
        pad = -lse_h.shape[-1] % _LSE_ALIGN
        if pad:
            lse_h = torch.nn.functional.pad(lse_h, (0, pad), value=float("inf"))
        # dropout is 0, so the philox seed/offset are never read.
        seed = torch.empty((), device=q.device, dtype=torch.int64)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            bhsd(dout.to(q.dtype)).contiguous(),
            bhsd(q),
            bhsd(kk),
            bhsd(vv),
            None,
            bhsd(out.to(q.dtype)),
            lse_h.contiguous(),
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return bhsd(dq), fold_kv_grad(bhsd(dk), groups), fold_kv_grad(bhsd(dv), groups)
