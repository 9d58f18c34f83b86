"""GPU-only local kernels: seqpar's kernel interface mapped onto torch's CUDA SDPA ops, which return the
log-sum-exp the ring merge needs. Deliberately thin: every decision (which kernel, which pieces go into
one call, gathers, merges) is made in CPU-tested code; here only layouts and op arguments.

- `FlashKernel` ("flash"): torch's flash op (FlashAttention-2, or the FA3 / FA4 the user activated),
  fp16/bf16. GQA native (K/V keep their heads; dK/dV come back at the KV heads). Varlen form:
  `aten._flash_attention_forward/_backward` on [T, H, D] rows with int32 cum_seq, lse [H, T].
- `CudnnKernel` ("cudnn"): cuDNN attention, fp16/bf16, GQA native, lse [B, H, S, 1], for dense calls (1.7x
  flash's speed on an H200: docs/gpu.md); packed calls go to flash's varlen op, pieces of one query or one key
  to flash's dense op (cuDNN refuses them).
- `EfficientKernel` ("efficient"): the memory-efficient op (also fp32). It needs equal head counts and no
  strided view can give a q head its KV head (head h reads kv h // G: not an affine map), so K/V are
  repeated (a copy) and dK/dV folded back; its lse is padded to a multiple of 32 rows.

A sliding window's banded call (attention.pieces: q row a sees key c iff lo <= a - c <= hi) runs on flash's varlen
op with its local window (`window_size_left` / `_right`, aligned bottom-right), the B rows as B sequences of one
call; flash skips the blocks out of reach itself, so these kernels take whole rectangles (`native_window`). cuDNN
hands banded calls to flash; the memory-efficient op (no window argument) runs them on the math kernel, as does
flash where a band has no window form (never for the pieces seqpar plans).

Backward calls pass what the forward op returned for the arguments that describe the call (undefined
cum_seq for dense calls, the forward's philox seed/offset tensors), as torch's own autograd does: a defined
cum_seq selects FlashAttention's varlen path, which demands int32 (the crash of every bf16 step before).
Dropout is always 0, so every forward of one kernel object returns the same kind of seed/offset; the object
keeps the last ones for its backward calls (the ring's backward runs on the merged out/lse, not on one
forward's). CI checks all of it on meta tensors under tests/cuda_op_spy.py (the CUDA ops' argument rules);
numerics of the logic around the calls on CPU through float64 emulations of the ops
(tests/test_cuda_emulated.py, every SP mode), and on a GPU (`make test-gpu`).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .kernel_utils import Band, bhsd, fold_kv_grad, repeat_kv
from .math_kernel import MathKernel

__all__ = ["FlashKernel", "CudnnKernel", "EfficientKernel", "CUDA_KERNELS"]

_LSE_ALIGN = 32  # the memory-efficient op's lse is [B, H, ceil(Sq / 32) * 32]
aten = torch.ops.aten


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The fused kernels read rows with any stride but need unit stride along head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


@lru_cache(maxsize=512)
def _cu_seqlens(cu: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 cumulative lengths on the device, made once per distinct plan (every layer reuses them)."""
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _flash_window(sq: int, sk: int, band: Band) -> tuple[int, int] | None:
    """FlashAttention's (left, right) window for a band (q row i sees keys i + sk - sq - left .. i + sk - sq + right),
    or None where the band has no such form (a negative side)."""
    left, right = sk - sq + band[1], -band[0] - (sk - sq)
    return (left, right) if left >= 0 and right >= 0 else None


def _math() -> MathKernel:
    return MathKernel()


class FlashKernel:
    name = "flash"
    varlen = True
    native_window = True

    def __init__(self) -> None:
        self._dense_aux = None  # (cum_seq_q, cum_seq_k, philox seed, philox offset) of the last dense forward
        self._varlen_aux = None  # (philox seed, philox offset) of the last varlen forward

    def forward(self, q, k, v, causal, scale, band=None):
        if band is not None:
            return self._band_forward(q, k, v, scale, band)
        res = aten._scaled_dot_product_flash_attention(bhsd(q), bhsd(k), bhsd(v), 0.0, causal, False, scale=scale)
        self._dense_aux = (res[2], res[3], res[6], res[7])
        return bhsd(res[0]), bhsd(res[1])

    def _band_forward(self, q, k, v, scale, band):
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        win = _flash_window(sq, sk, band)
        if win is None:
            return _math().forward(q, k, v, False, scale, band)
        cu_q, cu_k = tuple(range(0, b * sq + 1, sq)), tuple(range(0, b * sk + 1, sk))
        out, lse, seed, offset, _ = aten._flash_attention_forward(
            q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]),
            _cu_seqlens(cu_q, q.device), _cu_seqlens(cu_k, q.device), sq, sk, 0.0, False, False, scale=scale,
            window_size_left=win[0], window_size_right=win[1],
        )
        self._varlen_aux = (seed, offset)
        return out.view(q.shape), lse.t().reshape(b, sq, -1)

    def _band_backward(self, dout, q, k, v, out, lse, scale, band):
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        win = _flash_window(sq, sk, band)
        if win is None:
            return _math().backward(dout, q, k, v, out, lse, False, scale, band)
        cu_q, cu_k = tuple(range(0, b * sq + 1, sq)), tuple(range(0, b * sk + 1, sk))
        seed, offset = self._varlen_aux
        rows = lambda t, n: _last_contiguous(t.reshape(b * n, *t.shape[2:]))  # noqa: E731
        dq, dk, dv = aten._flash_attention_backward(
            rows(dout.to(q.dtype), sq), rows(q, sq), rows(k, sk), rows(v, sk), rows(out.to(q.dtype), sq),
            lse.reshape(b * sq, -1).t().float().contiguous(), _cu_seqlens(cu_q, q.device),
            _cu_seqlens(cu_k, q.device), sq, sk, 0.0, False, seed, offset, scale=scale,
            window_size_left=win[0], window_size_right=win[1],
        )
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        if band is not None:
            return self._band_backward(dout, q, k, v, out, lse, scale, band)
        cum_q, cum_k, seed, offset = self._dense_aux
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            bhsd(_last_contiguous(dout.to(q.dtype))), bhsd(q), bhsd(k), bhsd(v),
            bhsd(_last_contiguous(out.to(q.dtype))), bhsd(lse).float().contiguous(), cum_q, cum_k, q.shape[1],
            k.shape[1], 0.0, causal, seed, offset, scale=scale,
        )
        return bhsd(dq), bhsd(dk), bhsd(dv)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse, seed, offset, _ = aten._flash_attention_forward(
            q, k, v, _cu_seqlens(cu_q, q.device), _cu_seqlens(cu_k, q.device), max_q, max_k, 0.0, causal, False,
            scale=scale,
        )
        self._varlen_aux = (seed, offset)
        return out, lse.t()

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        seed, offset = self._varlen_aux
        return aten._flash_attention_backward(
            _last_contiguous(dout.to(q.dtype)), q, k, v, _last_contiguous(out.to(q.dtype)),
            lse.t().float().contiguous(), _cu_seqlens(cu_q, q.device), _cu_seqlens(cu_k, q.device), max_q, max_k,
            0.0, causal, seed, offset, scale=scale,
        )


class CudnnKernel:
    """cuDNN attention for dense calls. Calls that pack several documents run flash's varlen op (torch does
    not expose cuDNN's ragged form on every version), and so do pieces with one key or one query (a 1-token
    document, a 1-token zigzag chunk): cuDNN refuses s_kv = 1 ("cuDNN Frontend error: s_q = s_kv = 1 is not
    supported", torch 2.11; sdp_utils' check_cudnn_tensor_shapes on every release) and s_q = 1 before torch 2.9.
    Those go to flash's dense op, whose backward takes the given (ring-merged) out / lse like every kernel's."""

    name = "cudnn"
    varlen = True
    native_window = True  # (banded calls go to flash's window)

    def __init__(self) -> None:
        self._aux = None  # (philox seed, philox offset, cum_seq_q, cum_seq_k) of the last forward
        self._flash = FlashKernel()

    def forward(self, q, k, v, causal, scale, band=None):
        if band is not None or q.shape[1] == 1 or k.shape[1] == 1:
            return self._flash.forward(q, k, v, causal, scale, band)
        res = aten._scaled_dot_product_cudnn_attention(bhsd(q), bhsd(k), bhsd(v), None, True, 0.0, causal, False,
                                                       scale=scale)
        self._aux = (res[6], res[7], res[2], res[3])
        return bhsd(res[0]), bhsd(res[1].squeeze(-1))

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        if band is not None or q.shape[1] == 1 or k.shape[1] == 1:
            return self._flash.backward(dout, q, k, v, out, lse, causal, scale, band)
        seed, offset, cum_q, cum_k = self._aux
        # cuDNN reads out in the layout its forward allocated (q's dimension order, dense) and grad_out with out's
        # very strides; anything else gives wrong gradients without an error (torch 2.11): copy only then.
        o = bhsd(out.to(q.dtype))
        if not _dense_in_order_of(o, bhsd(q)):
            o = _alloc_in_order_of(bhsd(q), o.shape, q.dtype).copy_(o)
        do = bhsd(dout.to(q.dtype))
        if do.stride() != o.stride():
            do = torch.empty_like(o).copy_(do)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            do, bhsd(q), bhsd(k), bhsd(v), o, bhsd(lse).float().unsqueeze(-1).contiguous(), seed, offset, None,
            cum_q, cum_k, q.shape[1], k.shape[1], 0.0, causal, scale=scale,
        )
        return bhsd(dq), bhsd(dk), bhsd(dv)

    def varlen_forward(self, *args):
        return self._flash.varlen_forward(*args)

    def varlen_backward(self, *args):
        return self._flash.varlen_backward(*args)


def _order(ref: torch.Tensor) -> list[int]:
    return sorted(range(ref.dim()), key=lambda i: -ref.stride(i))


def _dense_in_order_of(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """t is dense with its dimensions in memory in ref's order (what cuDNN's forward would have allocated)."""
    return t.permute(_order(ref)).is_contiguous()


def _alloc_in_order_of(ref: torch.Tensor, shape, dtype) -> torch.Tensor:
    """An uninitialised dense tensor of `shape` whose dimensions lie in memory in ref's order (outermost stride
    first), as cuDNN's forward allocates its output for q."""
    order = _order(ref)
    buf = torch.empty([shape[i] for i in order], dtype=dtype, device=ref.device)
    return buf.permute([order.index(i) for i in range(ref.dim())])


class EfficientKernel:
    name = "efficient"
    varlen = False

    def __init__(self) -> None:
        self._aux = None  # (philox seed, philox offset) of the last forward

    def forward(self, q, k, v, causal, scale, band=None):
        if band is not None:
            return _math().forward(q, k, v, False, scale, band)
        groups = q.shape[2] // k.shape[2]
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            bhsd(q), bhsd(repeat_kv(k, groups)), bhsd(repeat_kv(v, groups)), None, True, 0.0, causal, scale=scale
        )
        self._aux = (seed, offset)
        return bhsd(out), bhsd(lse[..., : q.shape[1]])

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        if band is not None:
            return _math().backward(dout, q, k, v, out, lse, False, scale, band)
        seed, offset = self._aux
        groups = q.shape[2] // k.shape[2]
        # The op's lse in the padded layout it produced; padded rows hold +inf (probability 0).
        lse_h = bhsd(lse).float()
        pad = -lse_h.shape[-1] % _LSE_ALIGN
        if pad:
            lse_h = torch.nn.functional.pad(lse_h, (0, pad), value=float("inf"))
        # the op reads out's batch and head strides only, its row stride implied: [B, S, H, D] rows, as its forward
        # allocated them (another layout gives wrong gradients without an error)
        o = out.to(q.dtype)
        if not _bshd_rows(o):
            o = o.contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            bhsd(dout.to(q.dtype)).contiguous(), bhsd(q), bhsd(repeat_kv(k, groups)), bhsd(repeat_kv(v, groups)), None,
            bhsd(o), lse_h.contiguous(), seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
        )
        return bhsd(dq), fold_kv_grad(bhsd(dk), groups), fold_kv_grad(bhsd(dv), groups)


def _bshd_rows(t: torch.Tensor) -> bool:
    """t ([B, S, H, D]) has unit head_dim stride, heads D apart and rows H * D apart (any batch stride)."""
    b, s, h, d = t.shape
    return t.stride(3) == 1 and (h == 1 or t.stride(2) == d) and (s == 1 or t.stride(1) == h * d)


CUDA_KERNELS = {"flash": FlashKernel, "cudnn": CudnnKernel, "efficient": EfficientKernel}
