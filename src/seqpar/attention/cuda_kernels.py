"""GPU-only local kernel. NOT CI-tested: the project's machines have no GPU.

Kept deliberately thin: it maps seqpar's kernel interface onto torch's CUDA flash SDPA ops, which
return the log-sum-exp the ring merge needs. Nothing on the CPU path imports this module
(tests/test_kernels.py checks that). Validate on a GPU with:
    python -m seqpar.bench attention --kernel cuda ...   and   pytest -k kernel_equivalence
"""

from __future__ import annotations

import torch

from .kernels import _bhsd, _fold_kv_grad, _repeat_kv


class CudaSdpaKernel:
    name = "cuda"

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[2] // k.shape[2]
        # The flash op wants equal head counts: expand KV for GQA (gradients are folded back below).
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(_repeat_kv(k, groups)), _bhsd(_repeat_kv(v, groups)), 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]
        return _bhsd(out), _bhsd(lse.float())

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[2] // k.shape[2]
        sq, sk = q.shape[1], k.shape[1]
        kk, vv = _repeat_kv(k, groups), _repeat_kv(v, groups)
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout.to(q.dtype)).contiguous(),
            _bhsd(q),
            _bhsd(kk),
            _bhsd(vv),
            _bhsd(out.to(q.dtype)),
            _bhsd(lse).float().contiguous(),
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
        return _bhsd(dq), _fold_kv_grad(_bhsd(dk), groups), _fold_kv_grad(_bhsd(dv), groups)
