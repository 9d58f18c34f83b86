"""Head-chunked attention (attention.heads): every SP mode with the kernels run per group of heads, exact
against the float64 reference (tests/reference.py; fp32 tolerance 2e-5), GQA / MHA / uneven heads, packed
documents (through the varlen call paths too), B = 2; and the CUDA calls per chunk on meta tensors."""

from __future__ import annotations

import pytest
import torch
from cuda_op_spy import CudaOpSpy
from test_attention import _all_ranks_agree, _check, run_case

import seqpar
from seqpar import SeqParError
from seqpar.attention.heads import head_chunks
from seqpar.attention.kernels import CpuFlashKernel, VarlenByLoop
from seqpar.threaded import run_threaded

VARLEN = VarlenByLoop(CpuFlashKernel())


def test_chunks_cover_every_head_once_with_its_group():
    for hq, hkv in ((32, 8), (14, 2), (12, 12), (9, 3), (4, 1)):
        g = hq // hkv
        for c in (1, 2, 3, 4, 8, 16, 64):
            parts = head_chunks(hq, hkv, c)
            assert [h for p in parts for h in range(p[0], p[1])] == list(range(hq))  # every q head once, in order
            assert all(p[2] == p[0] // g and p[3] - 1 == (p[1] - 1) // g for p in parts)  # with its own kv heads
            if c <= hkv:
                assert len(parts) == c and all(a[3] == b[2] for a, b in zip(parts, parts[1:]))
                sizes = [p[3] - p[2] for p in parts]
            else:  # q heads of one group split: one kv head per chunk, at most one q head per chunk
                assert len(parts) == hkv * min(g, -(-c // hkv)) and all(p[3] - p[2] == 1 for p in parts)
                sizes = [p[1] - p[0] for p in parts]
            assert max(sizes) - min(sizes) <= 1


def test_world1_head_chunks_exact():
    mesh = seqpar.init_mesh(1)
    cases = []
    for chunks in (2, 3, 5):  # 5 > the kv heads of most cases: q heads of a group split, dK / dV added up
        for kern in ("auto", VARLEN):
            for hq, hkv in ((14, 2), (6, 6), (9, 3)):
                for b, cu in ((2, None), (1, [0, 1, 9, 30, 40])):
                    errs = run_case(mesh, hq, hkv, True, b, 40, cu=cu, kernel=kern, head_chunks=chunks)
                    cases.append(((chunks, str(kern), hq, hkv, b, str(cu), "float32"), errs))
    _check(cases)


def test_bad_head_chunks_refused():
    mesh = seqpar.init_mesh(1)
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(SeqParError, match="head_chunks must be an int >= 1, got 0"):
        seqpar.attention(q, q, q, mesh, head_chunks=0)


def chunked_world4():
    results = []
    many = [0, *range(3, 64, 5), 64]
    for u, r, layout in [(4, 1, "zigzag"), (1, 4, "zigzag"), (2, 2, "zigzag")]:
        mesh = seqpar.init_mesh(4, ulysses_degree=u, ring_degree=r, layout=layout)
        for hq, hkv in ((8, 4), (14, 2)):
            for kern, cu, b in (("auto", None, 2), ("auto", many, 1), (VARLEN, many, 1)):
                key = (u, r, hq, hkv, str(kern), str(cu), b, "float32")
                results.append((key, run_case(mesh, hq, hkv, True, b, 64, cu=cu, kernel=kern, head_chunks=3)))
    return results


def test_head_chunks_world4_all_modes():
    _check(_all_ranks_agree(run_threaded(chunked_world4, 4, timeout=400)))


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("hf_layout", [False, True])
def test_head_chunked_cuda_calls_on_meta(kernel, hf_layout):
    """World of 1, 32 q / 8 kv heads in 4 chunks: 4 launches each way, every one within the CUDA ops' rules."""
    mesh = seqpar.init_mesh(1)
    dtype = torch.float32 if kernel == "efficient" else torch.bfloat16

    def make(h):
        shape = (1, h, 1024, 128) if hf_layout else (1, 1024, h, 128)
        t = torch.empty(*shape, device="meta", dtype=dtype)
        return (t.transpose(1, 2) if hf_layout else t).requires_grad_()

    q, k, v = make(32), make(8), make(8)
    with CudaOpSpy() as spy:
        out = seqpar.attention(q, k, v, mesh, kernel=kernel, head_chunks=4)
        out.backward(torch.empty_like(out))
    assert sum(spy.launches.values()) == 8, spy.launches
    assert out.shape == q.shape and k.grad.shape == k.shape


def test_split_groups_add_kv_gradients_in_fp32():
    """When the chunks split one KV head's q heads, its dK / dV parts are added in fp32 and cast once (a bf16 sum
    loses them: 1 + 2^-8 + 2^-8 is 1 in bf16 steps, 1 + 2^-7 in fp32)."""
    from seqpar.attention.heads import HeadChunked

    class Parts:  # dK / dV of a call = 1 for the group's first q head, 2^-8 for each other one
        name, varlen = "parts", False

        def backward(self, dout, q, k, v, out, lse, causal, scale):
            first = 1.0 if self.seen == 0 else 2.0**-8
            self.seen += 1
            return torch.zeros_like(q), torch.full_like(k, first), torch.full_like(v, first)

    inner = Parts()
    inner.seen = 0
    q = torch.zeros(1, 4, 3, 8, dtype=torch.bfloat16)  # 3 q heads on 1 kv head, chunked into 3 calls
    kv = torch.zeros(1, 4, 1, 8, dtype=torch.bfloat16)
    _, dk, dv = HeadChunked(inner, 3).backward(q, q, kv, kv, q, q[..., 0].float(), True, 1.0)
    assert inner.seen == 3 and dk.dtype == torch.bfloat16
    assert float(dk.flatten()[0]) == float(dv.flatten()[0]) == 1 + 2.0**-7
