"""The CUDA kernel classes in every SP mode, on CPU: torch's CUDA attention ops replaced by float64 emulations.

`CudaOpSpy(emulate=True)` checks each CUDA op call against the real op's argument rules (tests/cuda_op_spy.py) and
returns what the op computes from those arguments (tests/cuda_op_emulation.py: the backward from the out / lse it
is GIVEN, the op's lse layout, GQA as the op takes it). Driven through `seqpar.attention` with the real kernel
classes (FlashKernel, CudnnKernel, EfficientKernel), the logic between the calls — ring merges, 1-key shortcuts,
varlen gathers, head chunks, Ulysses head plans — is checked numerically against the float64 reference
(tests/reference.py) in every mode: world 1, Ulysses 4, ring 4, odd ring 3, USP 2 x 2; GQA, MHA, kv heads < P, q
heads not divisible by P, B = 2, packed documents with 1-token documents and 1-key ring pieces, 1-token zigzag
chunks, head chunks that split a KV head's group. Worlds run as threads of this process (seqpar.threaded).

Tolerances: fp32 inputs (the spy's `precise` mode lets fp32 through the fused ops' dtype rule) 2e-5 absolute, as
tests/test_attention.py; bf16 4e-2 (out) / 1e-1 (gradients). The cuDNN 1-key bug this found gave errors 1 to 8.
"""

from __future__ import annotations

import pytest
import torch
from cuda_op_emulation import EMULATIONS, EmulatedOpRefused
from cuda_op_spy import CudaOpSpy, CudaRuleViolation
from reference import reference_attention
from test_attention import DTYPE_TOL, _check, run_case

import seqpar
from seqpar.attention.cuda_kernels import CudnnKernel, EfficientKernel, FlashKernel
from seqpar.threaded import run_threaded

KERNELS = {"flash": FlashKernel, "cudnn": CudnnKernel, "efficient": EfficientKernel}

# (name, hq, hkv, b, s, cu, extra seqpar.attention kwargs); s fits every mode's layout multiple (2 x ring x ulysses)
CASES = [
    ("gqa_b2", 6, 2, 2, 48, None, {}),
    ("mha", 4, 4, 1, 48, None, {}),
    ("kv_lt_p", 4, 1, 1, 24, None, {}),
    ("uneven_9_3", 9, 3, 1, 48, None, {}),
    ("packed_1tok_docs", 6, 2, 1, 48, [0, 1, 2, 9, 10, 23, 24, 25, 47, 48], {}),
    ("packed_1key_pieces", 6, 2, 1, 24, [0, 3, 4, 6, 7, 24], {}),
    ("head_chunks_split", 6, 2, 1, 24, [0, 5, 6, 24], {"head_chunks": 4}),
    ("head_chunks_dense", 8, 4, 2, 24, None, {"head_chunks": 2}),
]
MODES = {1: [(1, 1)], 2: [(1, 2)], 3: [(1, 3), (3, 1)], 4: [(4, 1), (1, 4), (2, 2)]}


def _one_token_chunks(ring: int, ulysses: int) -> list:
    """S = 2 x ring x ulysses: every zigzag chunk holds one token per Ulysses rank (1-key ring pieces everywhere)."""
    return [("one_token_chunks", 4, 2, 2, 2 * ring * ulysses, None, {})]


def _dtypes(u: int, r: int) -> tuple[torch.dtype, ...]:
    """fp32 everywhere; bf16 (the real ops' dtype rule, the half-precision casts: nothing layout-specific) in a world
    of 1 and at USP 2 x 2, which has both the Ulysses exchange and the ring merges."""
    return (torch.float32, torch.bfloat16) if (u, r) in ((1, 1), (2, 2)) else (torch.float32,)


def emulated_grid(sp: int):
    out, launches = [], {k: 0 for k in KERNELS}
    for u, r in MODES[sp]:
        mesh = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        for name, hq, hkv, b, s, cu, kw in CASES + _one_token_chunks(r, u):
            for kname, kcls in KERNELS.items():
                for dtype in _dtypes(u, r):
                    precise = dtype == torch.float32
                    with CudaOpSpy(emulate=True, precise=precise) as spy:
                        errs = run_case(mesh, hq, hkv, True, b, s, cu=cu, dtype=dtype, kernel=kcls(), **kw)
                    launches[kname] += sum(spy.launches.values())  # (cuDNN's 1-key pieces launch none)
                    out.append(((u, r, name, kname, str(dtype)), errs))
    assert all(launches.values()), f"a kernel class never reached its CUDA ops: {launches}"
    return out


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_cuda_kernels_every_mode_emulated(sp):
    """fp32 (the spy's precise mode: the logic at fp32 tolerance) in every mode; bf16 where _dtypes says."""
    res = run_threaded(emulated_grid, sp, sp, timeout=240)
    flat = [case for rank in res for case in rank]
    runs = sum(len(_dtypes(u, r)) for u, r in MODES[sp])
    assert len(flat) == sp * runs * (len(CASES) + 1) * len(KERNELS)
    _check(flat, DTYPE_TOL)


def _inputs(b, sq, sk, hq, hk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hk, sk, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(b, hq, sq, d, generator=g).to(dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_emulations_equal_the_reference(causal):
    """Each emulated op (dense flash, cuDNN, memory-efficient; varlen flash) against the float64 reference, on the
    op's own layout: [B, H, S, D] (dense), [T, H, D] + int32 cum_seq (varlen). Their forwards' lse feeds their
    backwards, so the pair is also autograd's gradient."""
    aten = torch.ops.aten
    q, k, v, do = _inputs(2, 24, 24, 6, 2, 16)

    def ref():
        qs, ks, vs = (t.transpose(1, 2).double().requires_grad_() for t in (q, k, v))
        o = reference_attention(qs, ks, vs, causal)
        o.backward(do.transpose(1, 2).double())
        return [o.transpose(1, 2), qs.grad.transpose(1, 2), ks.grad.transpose(1, 2), vs.grad.transpose(1, 2)]

    want = ref()
    with CudaOpSpy(emulate=True, precise=True):
        o, lse, *_, seed, off, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        g = aten._scaled_dot_product_flash_attention_backward(do, q, k, v, o, lse, None, None, 24, 24, 0.0, causal,
                                                              seed, off)
        got = {"flash": [o, *g]}
        o, lse, _, _, _, _, seed, off, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)
        g = aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, seed, off, None, None, None, 24, 24,
                                                              0.0, causal)
        got["cudnn"] = [o, *g]
        kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)  # the efficient op takes equal heads
        o, lse, seed, off = aten._scaled_dot_product_efficient_attention(q, kr, vr, None, True, 0.0, causal)
        assert lse.shape[-1] == 32  # rows padded to a multiple of 32
        g = aten._scaled_dot_product_efficient_attention_backward(do, q, kr, vr, None, o, lse, seed, off, 0.0,
                                                                  [True, True, True, False], causal)
        got["efficient"] = [o, g[0], g[1].view(2, 2, 3, 24, 16).sum(2), g[2].view(2, 2, 3, 24, 16).sum(2)]
    for name, vals in got.items():
        for a, w in zip(vals, want):
            assert float((a.double() - w).abs().max()) < 2e-5, name


def test_emulated_varlen_equals_per_sequence_reference():
    aten = torch.ops.aten
    cu = [0, 1, 9, 10, 24]
    q, k, v, do = (t[0].transpose(0, 1).contiguous() for t in _inputs(1, 24, 24, 6, 2, 16, seed=3))
    cut = torch.tensor(cu, dtype=torch.int32)
    with CudaOpSpy(emulate=True, precise=True):
        o, lse, seed, off, _ = aten._flash_attention_forward(q, k, v, cut, cut, 14, 14, 0.0, True, False)
        assert lse.shape == (6, 24)
        g = aten._flash_attention_backward(do, q, k, v, o, lse, cut, cut, 14, 14, 0.0, True, seed, off)
    qs, ks, vs = (t[None].double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qs, ks, vs, True, cu)
    ref.backward(do[None].double())
    for a, w in zip((o, *g), (ref, qs.grad, ks.grad, vs.grad)):
        assert float((a.double() - w[0]).abs().max()) < 2e-5


def test_emulations_refuse_what_the_ops_refuse():
    aten = torch.ops.aten
    q, k, v, _ = _inputs(1, 8, 12, 4, 2, 16, dtype=torch.bfloat16)
    with CudaOpSpy(emulate=True), pytest.raises(EmulatedOpRefused, match="bottom-right"):
        aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)  # causal, Sq != Sk: alignment differs
    q1, k1, v1, _ = _inputs(1, 1, 1, 4, 2, 16, dtype=torch.bfloat16)
    with CudaOpSpy(emulate=True), pytest.raises((EmulatedOpRefused, CudaRuleViolation), match="s_q = s_kv = 1"):
        aten._scaled_dot_product_cudnn_attention.default(q1, k1, v1, None, True, 0.0, True, False)
    assert len(EMULATIONS) == 8


def test_cudnn_one_key_inside_a_ring_merge_regression():
    """The case that was wrong: ring 2, 1-token zigzag chunks (every piece one key, merged), cuDNN's kernel class.
    Errors were 2.2 / 2.7 / 4.9 (dq / dk / dv); they must be fp32 round-off now."""
    def world():
        mesh = seqpar.init_mesh(2, ulysses_degree=1, ring_degree=2)
        with CudaOpSpy(emulate=True, precise=True):
            return run_case(mesh, 6, 2, True, 2, 4, kernel=CudnnKernel())

    for errs in run_threaded(world, 2, timeout=60):
        assert max(errs) < 2e-5, errs


def variants_grid(sp: int):
    """Sliding windows, sinks and MLA through the CUDA kernel classes (flash's window, cuDNN's hand-over to it, the
    memory-efficient op's math fallback for banded calls), on the emulated ops; fp32, the spy's precise mode."""
    from test_attention_variants import run_variant

    out = []
    modes = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(2, 2)]}[sp]
    cases = [(6, 2, 1, 48, None, [0, 7, 30, 31, 48], 9, False), (4, 2, 2, 48, None, None, 13, True),
             (4, 1, 1, 48, 24, [0, 17, 48], 5, True)]
    for u, r in modes:
        mesh = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        for i, (hq, hkv, b, s, dv, cu, window, sinks) in enumerate(cases):
            for kname, kcls in KERNELS.items():
                with CudaOpSpy(emulate=True, precise=True):
                    errs = run_variant(mesh, hq, hkv, b, s, dv=dv, cu=cu, window=window, sinks=sinks, seed=i,
                                       kernel=kcls())
                out.append(((u, r, i, kname), errs))
    return out


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_cuda_kernels_attention_variants_emulated(sp):
    res = run_threaded(variants_grid, sp, sp, timeout=240)
    bad = [(k, e) for rank in res for k, e in rank if max(e) > 2e-5]
    assert not bad, bad
