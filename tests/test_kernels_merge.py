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
from seqpar.errors import SeqParError


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


# ----------------------------------------------------------------------------- kernel routing (GPU-free)
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# (torch, capability, cuDNN, dtype, head_dim, training, what 'auto' picks, the sdp_utils.cpp rule that decides)
ROUTES = [
    ("2.13", (9, 0), 91900, BF16, 128, True, "cudnn", "sdp priority: cuDNN first on sm9x / sm10x, cuDNN > 9.15"),
    ("2.13", (9, 0), 91500, BF16, 128, True, "flash", "sdp priority: cuDNN 9.15.0 is not above 9.15"),
    ("2.11", (10, 3), 91900, BF16, 128, True, "cudnn", "sdp priority (2.10+): sm100 / sm103"),
    ("2.11", (9, 4), 91900, BF16, 128, True, "flash", "sdp priority (2.10-2.12): minor 0 or 3 only"),
    ("2.13", (9, 4), 91900, BF16, 128, True, "cudnn", "sdp priority (2.13): any minor"),
    ("2.9", (9, 0), 91900, BF16, 128, True, "flash", "sdp priority before 2.10: flash first"),
    ("2.13", (8, 9), 91900, BF16, 128, True, "flash", "cuDNN first only on sm9x / sm10x"),
    ("2.13", (12, 0), 91900, BF16, 128, True, "flash", "check_cudnn_hardware_support: sm120 is not preferred"),
    ("2.13", (9, 0), 91900, BF16, 256, True, "flash", "seqpar keeps cudnn to head_dim <= 128 (check_cudnn_d256_...)"),
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: no flash backward for 192 < d <= 224
    ("2.13", (8, 6), None, BF16, 200, True, "efficient", "..._gt192_constraints_on_sm86_89_or_120 (training)"),
    ("2.13", (8, 9), None, BF16, 224, True, "efficient", "..._gt192_constraints_on_sm86_89_or_120 (training)"),
    ("2.13", (12, 0), None, BF16, 200, True, "efficient", "..._gt192_constraints_on_sm86_89_or_120 (training)"),
    ("2.13", (12, 1), None, BF16, 200, True, "efficient", "sm121 in the gate from 2.8"),
    ("2.7", (12, 1), None, BF16, 200, True, "math", "check_flash/mem_efficient_hardware_support (2.7): not sm121"),
    ("2.13", (8, 6), None, BF16, 200, False, "flash", "the gate is for backward only (eval runs flash)"),
    ("2.13", (8, 6), None, BF16, 232, True, "flash", "..._gt192_...: d > 224 refused only with dropout"),
    ("2.13", (8, 0), None, BF16, 200, True, "flash", "the gate is not on sm80 / sm90"),
    # check_mem_efficient_hardware_support + less_than_sm80_mem_efficient_dtypes
    ("2.13", (7, 5), None, BF16, 128, True, "math", "less_than_sm80_mem_efficient_dtypes: no bf16 on T4 / V100"),
    ("2.13", (7, 5), None, F16, 128, True, "efficient", "check_flash_attention_hardware_support: no flash < sm80"),
    ("2.13", (7, 0), None, F32, 36, True, "efficient", "check_head_dim_size_mem_efficient: fp32 alignment 1 < sm80"),
    ("2.13", (9, 0), None, F32, 36, True, "efficient", "check_head_dim_size_mem_efficient: fp32 alignment 4"),
    ("2.13", (9, 0), None, BF16, 36, True, "math", "mha_fwd / mem-efficient: head_dim % 8 in half precision"),
    ("2.13", (9, 0), None, BF16, 320, True, "efficient", "check_head_dim_size_flash: <= 256"),
    ("2.13", (9, 0), 91900, F32, 128, True, "efficient", "check_dtypes_low_precision: flash / cudnn fp16, bf16"),
    ("2.13", (9, 0), 91900, F64, 128, True, "math", "no fused kernel takes fp64"),
    ("2.13", (4, 0), None, F32, 128, True, "math", "check_mem_efficient_hardware_support: sm50+"),
    ("2.6", (10, 0), None, BF16, 128, True, "math", "check_*_hardware_support (2.6): up to sm90"),
    ("2.6", (9, 0), 91900, BF16, 128, True, "flash", "2.6: no cuDNN preference"),
]


@pytest.mark.parametrize("version,cap,cudnn,dtype,d,training,want,rule", ROUTES, ids=[r[7] for r in ROUTES])
def test_auto_routing_follows_torchs_rules(version, cap, cudnn, dtype, d, training, want, rule):
    """'auto' per torch release (kernel_choice.TORCH_RULES), GPU, cuDNN, dtype, head_dim, training: never a kernel
    torch's dispatcher would refuse for these inputs (the rule named), the preferred one where it may choose."""
    from seqpar.attention.kernel_choice import kernel_name_for, kernel_problem

    tv = tuple(int(x) for x in version.split("."))
    got = kernel_name_for("cuda", dtype, d, cap, cudnn, training=training, torch_version=tv)
    assert got == want, rule
    if got != "math":
        assert kernel_problem(got, "cuda", dtype, d, cap, training=training, torch_version=tv) is None


def test_auto_routing_without_a_gpu_reading():
    from seqpar.attention.kernel_choice import kernel_name_for

    # torch's CUDA flash op takes fp16/bf16 only: fp32 (the default) must go to the efficient op, fp64 to math.
    assert [kernel_name_for("cuda", d) for d in (F16, BF16, F32, F64)] == ["flash", "flash", "efficient", "math"]
    assert {kernel_name_for("cpu", d) for d in (F16, BF16, F32, F64)} == {"cpu"}
    assert {kernel_name_for("mps", d) for d in (F16, F32)} == {"math"}
    assert kernel_name_for("cuda", BF16, 128, (9, 0), 91900, "FA3") == "flash"  # an activated FA3 / FA4 wins


def test_cudnn_refused_before_torch_2_8_and_old_torch_refused():
    from seqpar.attention.kernel_choice import kernel_problem, torch_rules

    assert "torch >= 2.8" in kernel_problem("cudnn", "cuda", BF16, 128, (9, 0), torch_version=(2, 7))
    assert kernel_problem("cudnn", "cuda", BF16, 128, (9, 0), torch_version=(2, 8)) is None
    assert torch_rules((2, 20)) is torch_rules((2, 13))  # later releases: the last known rules
    with pytest.raises(SeqParError, match="torch >= 2.6"):
        torch_rules((2, 5))


def test_explicit_kernel_refuses_what_it_cannot_run():
    from seqpar import SeqParError
    from seqpar.attention.kernels import get_kernel

    cuda = torch.device("cuda")
    with pytest.raises(SeqParError, match="'flash' does not support torch.float32.*picks 'efficient'"):
        get_kernel(cuda, "cuda", torch.float32)  # 'cuda': the old name of 'flash'
    with pytest.raises(SeqParError, match="'efficient' does not support torch.float64.*'math'"):
        get_kernel(cuda, "cuda_efficient", torch.float64)
    with pytest.raises(SeqParError, match="'flash' needs head_dim a multiple of 8, got 12"):
        get_kernel(cuda, "flash", torch.bfloat16, head_dim=12)
    with pytest.raises(SeqParError, match="'cudnn' takes head_dim <= 128, got 256"):
        get_kernel(cuda, "cudnn", torch.bfloat16, head_dim=256)
    with pytest.raises(SeqParError, match="'flash' runs on cuda tensors, not cpu"):
        get_kernel(torch.device("cpu"), "flash", torch.bfloat16)
    with pytest.raises(SeqParError, match="unknown attention kernel 'fa9'"):
        get_kernel(cuda, "fa9", torch.bfloat16)
    assert get_kernel(cuda, "auto", torch.float64).name == "math"
    assert get_kernel(torch.device("cpu"), "auto", torch.float32).name == "cpu"


def test_kernel_choice_line_names_the_flash_implementation():
    from seqpar.attention.kernel_choice import describe_choice

    line = describe_choice(torch.device("cuda"), "auto", torch.bfloat16, 128)
    assert line.startswith("attention kernel: flash (auto; cuda") and "flash implementation FA2" in line
    assert "efficient (forced" in describe_choice(torch.device("cuda"), "efficient", torch.float32, 64)


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
