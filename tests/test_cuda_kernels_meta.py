"""The CUDA path without a GPU: every CUDA kernel call seqpar makes, on meta tensors, under CudaOpSpy.

The spy (tests/cuda_op_spy.py) checks each call of torch's CUDA attention ops against the rules the real
CUDA ops enforce (or silently rely on), then runs torch's meta implementation for the output shapes. Here:
each kernel class alone (dense, GQA, MHA, uneven heads, B > 1, varlen), `seqpar.attention` end to end in a
world of 1 with autograd (dense, packed: ONE varlen launch per direction for 64 documents), one Ulysses rank's
local calls on views of its exchange buffer, and a zigzag ring step's calls with many documents. Numerics
of the same calls run on a GPU in tests/gpu (`make test-gpu`).
"""

from __future__ import annotations

import pytest
import torch
from cuda_op_spy import CudaOpSpy, CudaRuleViolation

import seqpar
from seqpar.attention.cuda_kernels import CudnnKernel, EfficientKernel, FlashKernel
from seqpar.attention.local import local_backward, local_calls, local_forward
from seqpar.attention.pieces import plan_calls
from seqpar.attention.ring import block_backward, block_forward
from seqpar.layout import ring_segments

HALF = (torch.bfloat16, torch.float16)
KERNELS = [(FlashKernel, HALF), (CudnnKernel, HALF), (EfficientKernel, (torch.float32, torch.bfloat16))]
SHAPES = [(1, 40, 32, 8, 128), (2, 33, 14, 2, 64), (1, 64, 12, 12, 64), (2, 24, 9, 3, 16)]


def _meta(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize("kcls,dtypes", KERNELS, ids=lambda x: getattr(x, "name", ""))
@pytest.mark.parametrize("b,s,hq,hkv,d", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hf_layout", [False, True])
def test_kernel_classes_pass_the_cuda_rules(kcls, dtypes, b, s, hq, hkv, d, causal, hf_layout):
    """hf_layout: q/k/v as Hugging Face models hand them over ([B, H, S, D] memory seen as [B, S, H, D])."""
    def make(h, dtype):
        return _meta(b, h, s, d, dtype=dtype).transpose(1, 2) if hf_layout else _meta(b, s, h, d, dtype=dtype)

    for dtype in dtypes:
        kern = kcls()
        q, k, v = make(hq, dtype), make(hkv, dtype), make(hkv, dtype)
        with CudaOpSpy() as spy:
            out, lse = kern.forward(q, k, v, causal, 0.1)
            assert out.shape == q.shape and out.dtype == dtype
            assert lse.shape == (b, s, hq) and lse.dtype == torch.float32
            # the ring hands backward its merged out / lse: fresh [B, S, H, *] tensors, not the forward's
            merged_out, merged_lse = _meta(b, s, hq, d, dtype=dtype), _meta(b, s, hq, dtype=torch.float32)
            dout = _meta(b, s, hq, d, dtype=dtype).transpose(0, 0)
            for o, lse_ in ((out, lse), (merged_out, merged_lse)):
                dq, dk, dv = kern.backward(dout, q, k, v, o, lse_, causal, 0.1)
                assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape  # GQA: kv heads
        assert sum(spy.launches.values()) == 3


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cu_k,max_k", [((0, 5, 17, 40), 23), ((0, 9, 20, 56), 36)], ids=["same_len", "longer_kv"])
def test_flash_varlen_passes_the_cuda_rules(causal, cu_k, max_k):
    """Queries and keys with the same or other document lengths (a ring step's pieces), causal or not; dout, out, k
    and v distinct tensors (an argument passed in another's place would go unseen where the shapes agree)."""
    kern = FlashKernel()
    cu_q, t_k = (0, 5, 17, 40), cu_k[-1]
    q, k, v = _meta(40, 32, 128), _meta(t_k, 8, 128), _meta(t_k, 8, 128)
    with CudaOpSpy() as spy:
        out, lse = kern.varlen_forward(q, k, v, cu_q, cu_k, 23, max_k, causal, 0.1)
        assert out.shape == q.shape and lse.shape == (40, 32)
        dout = _meta(40, 32, 128)
        dq, dk, dv = kern.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 23, max_k, causal, 0.1)
        # the merged out / lse of a ring step: fresh tensors, the lse [T, H] in seqpar's layout, not the kernel's
        merged_out, merged_lse = _meta(40, 32, 128), _meta(40, 32, dtype=torch.float32)
        kern.varlen_backward(dout, q, k, v, merged_out, merged_lse, cu_q, cu_k, 23, max_k, causal, 0.1)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert spy.launches == {"_flash_attention_forward": 1, "_flash_attention_backward": 2}


def test_the_old_bf16_backward_call_is_refused():
    """Before the fix, every bf16 backward passed an empty int64 tensor as cum_seq_q/k: the GPU crashed with
    'cu_seqlens_q must have dtype int32'. The meta op accepts it; the spy must not."""
    q = _meta(1, 8, 64, 64)
    k = _meta(1, 8, 64, 64)
    with CudaOpSpy():
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, k, 0.0, True, False, scale=0.1)
        empty = torch.empty(0, device="meta", dtype=torch.int64)
        with pytest.raises(CudaRuleViolation, match="cum_seq_q is defined"):
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                res[0], q, k, k, res[0], res[1], empty, empty, 64, 64, 0.0, True, empty, empty, scale=0.1)
        with pytest.raises(CudaRuleViolation, match="philox seed/offset are not the tensors"):
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                res[0], q, k, k, res[0], res[1], None, None, 64, 64, 0.0, True, empty, empty, scale=0.1)
        with pytest.raises(CudaRuleViolation, match="logsumexp"):  # a transposed lse: wrong grads, no error
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                res[0], q, k, k, res[0], res[1].transpose(1, 2).contiguous().transpose(1, 2), None, None, 64, 64,
                0.0, True, res[6], res[7], scale=0.1)
        with pytest.raises(CudaRuleViolation, match="head_dim"):
            torch.ops.aten._scaled_dot_product_flash_attention(_meta(1, 2, 8, 60), _meta(1, 2, 8, 60),
                                                               _meta(1, 2, 8, 60), 0.0, True, False)
        with pytest.raises(CudaRuleViolation, match="no GQA"):
            torch.ops.aten._scaled_dot_product_efficient_attention(_meta(1, 4, 8, 64), _meta(1, 2, 8, 64),
                                                                   _meta(1, 2, 8, 64), None, True, 0.0, True)


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (14, 2), (12, 12)])
def test_seqpar_attention_world1_end_to_end_on_meta(kernel, hq, hkv):
    mesh = seqpar.init_mesh(1)
    dtype = torch.float32 if kernel == "efficient" else torch.bfloat16
    q, k, v = (_meta(1, 4096, h, 128, dtype=dtype, grad=True) for h in (hq, hkv, hkv))
    with CudaOpSpy() as spy:
        out = seqpar.attention(q, k, v, mesh, kernel=kernel)
        out.backward(torch.empty_like(out))
    assert out.shape == q.shape and k.grad.shape == k.shape
    assert sum(spy.launches.values()) == 2, spy.launches  # one kernel call each way, nothing else


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_packed_row_is_one_varlen_launch_each_way(kernel):
    """A 128K row packed from 2K-token documents (64 of them): one varlen flash call forward, one backward."""
    mesh = seqpar.init_mesh(1)
    s = 131072
    q, k, v = (_meta(1, s, h, 128, grad=True) for h in (32, 8, 8))
    with CudaOpSpy() as spy:
        out = seqpar.attention(q, k, v, mesh, cu_seqlens=list(range(0, s + 1, 2048)), kernel=kernel)
        out.backward(torch.empty_like(out))
    assert spy.launches == {"_flash_attention_forward": 1, "_flash_attention_backward": 1}


def test_cudnn_one_token_document_runs_without_cudnn():
    """cuDNN refuses a piece with one key (and, before torch 2.9, one query): a 1-token document takes flash's dense
    op, the rest cuDNN; a 1-row piece against many keys too."""
    from seqpar.attention.calls import call_backward, call_forward
    from seqpar.attention.pieces import KernelCall, Piece

    kern = CudnnKernel()
    q, k, v = _meta(1, 9, 4, 64), _meta(1, 9, 2, 64), _meta(1, 9, 2, 64)
    with CudaOpSpy() as spy:
        for p in (Piece(0, 1, 0, 1, True), Piece(1, 9, 1, 9, True), Piece(8, 9, 0, 8, False)):
            call = KernelCall(True, (p,))
            o, lse = call_forward(kern, call, q, k, v, 0.1)
            dout, out = _meta(1, 9, 4, 64), _meta(1, 9, 4, 64)
            call_backward(kern, call, dout, q, k, v, out, _meta(1, 9, 4, dtype=torch.float32), 0.1)
    assert spy.launches == {"_scaled_dot_product_cudnn_attention": 1, "_scaled_dot_product_cudnn_attention_backward": 1,
                            "_scaled_dot_product_flash_attention": 2, "_scaled_dot_product_flash_attention_backward": 2}


def test_ulysses_rank_local_calls_on_exchange_buffer_views():
    """A Ulysses rank runs the local calls on q/k/v views of its receive buffer [B, S, q + 2 kv heads, D]."""
    s, nq, nk, d = 2048, 8, 2, 128
    x = _meta(1, s, nq + 2 * nk, d)
    q, k, v = x[:, :, :nq], x[:, :, nq : nq + nk], x[:, :, nq + nk :]
    for cu in (None, [0, 100, 1000, 2048]):
        kern = FlashKernel()
        calls = local_calls(s, True, cu[1:-1] if cu else None, kern, 1)
        with CudaOpSpy() as spy:
            out, lse = local_forward(kern, q, k, v, calls, 0.1)
            local_backward(kern, _meta(1, s, nq, d), q, k, v, out, lse, calls, 0.1)
        assert sum(spy.launches.values()) == 2


@pytest.mark.parametrize("bounds", [None, list(range(64, 4096, 64))])
def test_zigzag_ring_step_calls_on_meta(bounds):
    """Every (rank, step) of a ring of 4 over a zigzag layout: at most two launches per step each way."""
    s, ring = 4096, 4
    segs = [ring_segments(s, ring, r, "zigzag") for r in range(ring)]
    n = s // ring
    for r in range(ring):
        for j in range(ring):
            kern = FlashKernel()
            q, kk, vv = _meta(1, n, 32, 128), _meta(1, n, 8, 128), _meta(1, n, 8, 128)
            out = _meta(1, n, 32, 128, dtype=torch.float32)
            lse = _meta(1, n, 32, dtype=torch.float32)
            calls = plan_calls(segs[r], segs[j], True, bounds, True)
            with CudaOpSpy() as spy:
                block_forward(kern, calls, q, kk, vv, 0.1, out, lse, [(0, n)])
                block_backward(kern, calls, _meta(1, n, 32, 128), q, kk, vv, out.to(torch.bfloat16), lse, 0.1,
                               _meta(1, n, 32, 128, dtype=torch.float32))
            assert sum(spy.launches.values()) <= 4 and len(calls) <= 2
