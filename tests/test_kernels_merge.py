"""Local kernels against the float64 reference, the LSE merge, and a CUDA-free CPU path."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import run_command
from reference import reference_attention

from seqpar.attention.kernels import CpuFlashKernel, MathKernel, default_scale
from seqpar.attention.merge import merge_


@pytest.mark.parametrize("kernel", [CpuFlashKernel(), MathKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-10), (torch.bfloat16, 5e-2)])
def test_kernel_forward_backward(kernel, causal, hq, hkv, dtype, tol):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 24, h, 16, generator=g) for h in (hq, hkv, hkv))
    do = torch.randn(2, 24, hq, 16, generator=g)
    scale = default_scale(16)
    ql, kl, vl = (t.to(dtype) for t in (q, k, v))
    out, lse = kernel.forward(ql, kl, vl, causal, scale)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (2, 24, hq)
    dq, dk, dv = kernel.backward(do.to(dtype), ql, kl, vl, out, lse, causal, scale)
    qr, kr, vr = (t.to(dtype).double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal)
    ref.backward(do.to(dtype).double())
    for got, want in ((out, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() < tol


def _lse_out(scores, values):
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ values, lse


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 40), cut=st.integers(1, 39), shift=st.floats(-80, 80), empty_left=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_merge_equals_softmax_over_union(n, cut, shift, empty_left, seed):
    cut = min(cut, n - 1)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, n, generator=g, dtype=torch.float64) * 5
    scores[:, :cut] += shift  # large offsets must not overflow
    vals = torch.randn(n, 4, generator=g, dtype=torch.float64)
    want_out, want_lse = _lse_out(scores, vals)
    out = torch.zeros(3, 4, dtype=torch.float64)
    lse = torch.full((3,), float("-inf"), dtype=torch.float64)
    if not empty_left:
        o, lb = _lse_out(scores[:, :cut], vals[:cut])
        merge_(out, lse, o, lb)
        o, lb = _lse_out(scores[:, cut:], vals[cut:])
        merge_(out, lse, o, lb)
    else:
        o, lb = _lse_out(scores, vals)
        merge_(out, lse, o, lb)
    assert torch.allclose(out, want_out, atol=1e-10) and torch.allclose(lse, want_lse, atol=1e-10)


def test_merge_handles_empty_rows_without_nan():
    out = torch.zeros(2, 3)
    lse = torch.tensor([float("-inf"), 1.0])
    out[1] = 7.0
    merge_(out, lse, torch.ones(2, 3), torch.tensor([float("-inf"), float("-inf")]))
    assert torch.isneginf(lse[0]) and torch.equal(out[0], torch.zeros(3))
    assert lse[1] == 1.0 and torch.equal(out[1], torch.full((3,), 7.0))
    merge_(out, lse, torch.full((2, 3), 2.0), torch.tensor([0.5, float("-inf")]))
    assert lse[0] == 0.5 and torch.equal(out[0], torch.full((3,), 2.0))
    assert torch.isfinite(out).all()


def test_cpu_path_imports_nothing_cuda_only():
    code = (
        "import sys, torch, seqpar\n"
        "from seqpar.attention.kernels import get_kernel\n"
        "m = seqpar.init_mesh(1)\n"
        "q = torch.randn(1, 8, 2, 8, requires_grad=True)\n"
        "seqpar.attention(q, q, q, m).sum().backward()\n"
        "assert get_kernel(torch.device('cpu')).name == 'cpu'\n"
        "bad = [n for n in sys.modules if n.startswith(('flash_attn', 'seqpar.attention.cuda_kernels'))]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    r = run_command([sys.executable, "-c", code], timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ----------------------------------------------------------------------------- no import cycle
@pytest.mark.parametrize("first", ["seqpar.attention.cuda_kernels", "seqpar.attention.kernels"])
def test_kernel_modules_import_first_in_fresh_interpreter(first):
    r = run_command([sys.executable, "-c", f"import {first}; print('ok')"], timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_kernel_modules_do_not_import_each_other_at_module_level():
    import ast
    import importlib
    from pathlib import Path

    root = Path(importlib.import_module("seqpar.attention.kernels").__file__).parent
    for mod, other in (("cuda_kernels", "kernels"), ("kernels", "cuda_kernels")):
        tree = ast.parse((root / f"{mod}.py").read_text())
        top = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert not [n for n in top if n.module == other], f"{mod}.py imports .{other} at module level"


def test_cuda_workspace_on_cpu_kernel_is_the_cpu_kernel():
    """kernels.CudaWorkspaceOnCpu only holds CUDA's backward workspace for the meter: the same numbers as "cpu"."""
    from seqpar.attention.kernels import CudaWorkspaceOnCpu, get_kernel

    assert get_kernel(torch.device("cpu"), "cpu_cuda_workspace").name == "cpu_cuda_workspace"
    g = torch.Generator().manual_seed(2)
    q, do = (torch.randn(1, 24, 6, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 24, 2, 16, generator=g) for _ in range(2))
    out, lse = CpuFlashKernel().forward(q, k, v, True, 0.25)
    got = CudaWorkspaceOnCpu().backward(do, q, k, v, out, lse, True, 0.25)
    for a, b in zip(got, CpuFlashKernel().backward(do, q, k, v, out, lse, True, 0.25)):
        assert torch.equal(a, b)
