"""SP > 1 on ONE GPU (`make test-gpu`; skipped without CUDA): the ranks are threads of this process (seqpar.threaded).

1. seqpar.attention at Ulysses 4, ring 4 and USP 2 x 2 with every CUDA kernel this GPU and torch allow (auto, flash,
   cudnn, efficient), in bf16 / fp16 / fp32: a packed row with 1-token documents and 1-key ring pieces, GQA 16 / 4,
   d = 128; and B = 2, MHA 12 / 12, d = 64. Criterion per tensor (out, dq, dk, dv): error relative to float64 at
   most 2x torch SDPA's own error on the same inputs (world of 1, the full sequence), or under a floor (1e-3 half,
   1e-5 fp32): sequence parallelism on the real kernels adds no error beyond the kernel's.
2. `seqpar train` at SP 4 (Ulysses 4, ring 4, USP 2 x 2) equal to SP 1: Llama-shaped and Qwen3.5-shaped (Gated
   DeltaNet; flash-linear-attention's kernels where installed) tiny models, fp32 (TF32 off) within 1e-5 relative
   per step (loss, grad_norm, SGD); Llama in bf16 within 2e-2.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_attention import _grads, _reference, _rel, _torch_sdpa
from threaded_cases import compare_rows, train_rows

import seqpar
from seqpar.attention.kernel_choice import kernel_problem
from seqpar.threaded import run_threaded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MODES = [(4, 1), (1, 4), (2, 2)]
CASES = [  # (B, S, Hq, Hkv, D, cu_seqlens): S a multiple of 2 x ring x ulysses = 8
    (1, 2048, 16, 4, 128, [0, 1, 2, 700, 701, 1500, 1503, 2048]),
    (2, 1024, 12, 12, 64, None),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _sp_world(u, r, q, k, v, w, cu, kernel):
    """One rank: its shards of the (shared) inputs through seqpar.attention, the results gathered in full."""
    mesh = seqpar.init_mesh(u * r, ulysses_degree=u, ring_degree=r)
    ql, kl, vl = (seqpar.shard(t, mesh, 1).detach().clone().requires_grad_() for t in (q, k, v))
    o = seqpar.attention(ql, kl, vl, mesh, cu_seqlens=cu, kernel=kernel)
    (o.to(w.dtype) * seqpar.shard(w, mesh, 1)).sum().backward()
    return [seqpar.unshard(t.detach(), mesh, 1) for t in (o, ql.grad, kl.grad, vl.grad)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}S{c[1]}h{c[2]}/{c[3]}d{c[4]}{'packed' if c[5] else ''}")
def test_sp4_attention_on_one_gpu_within_torch_sdpa_error(dtype, case):
    b, s, hq, hkv, d, cu = case
    g = torch.Generator(device="cuda").manual_seed(s + hq)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
    w = torch.randn(b, s, hq, d, device="cuda", generator=g, dtype=torch.float64)
    ref = _grads(_reference, q.double(), k.double(), v.double(), w, cu)
    sdpa = [_rel(x, y) for x, y in zip(_grads(_torch_sdpa, q, k, v, w, cu), ref)]
    cap = torch.cuda.get_device_capability()
    bad, ran = [], 0
    for kernel in ("auto", "flash", "cudnn", "efficient"):
        if kernel != "auto" and kernel_problem(kernel, "cuda", dtype, d, cap) is not None:
            continue
        for u, r in MODES:
            got = run_threaded(_sp_world, u * r, u, r, q, k, v, w, cu, kernel, device="cuda", timeout=300)[0]
            errs = [_rel(x, y) for x, y in zip(got, ref)]
            ran += 1
            if any(e > max(2 * t, FLOOR[dtype]) for e, t in zip(errs, sdpa)):
                bad.append((kernel, (u, r), errs))
    assert ran >= len(MODES), "no CUDA kernel could run this case"
    assert not bad, f"torch SDPA's errors {sdpa}; over 2x: {bad}"


@pytest.fixture
def no_tf32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 convs / matmuls
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("model", ["llama", "qwen3_5"])
def test_train_sp4_equals_sp1_on_one_gpu(tmp_path, no_tf32, model):
    ref = train_rows(tmp_path / "sp1", model, 1, 1, device="cuda")
    for u, r in MODES:
        compare_rows(train_rows(tmp_path / f"u{u}r{r}", model, u, r, device="cuda"), ref, 1e-5)


def test_train_bf16_sp4_matches_sp1_on_one_gpu(tmp_path):
    ref = train_rows(tmp_path / "sp1", "llama", 1, 1, precision="bf16", device="cuda")
    for u, r in MODES:
        compare_rows(train_rows(tmp_path / f"u{u}r{r}", "llama", u, r, precision="bf16", device="cuda"), ref, 2e-2)
