"""On a GPU (`make test-gpu`; skipped without CUDA): every CUDA kernel and seqpar.attention against float64.

Criterion, per case and tensor (out, dq, dk, dv): seqpar's error relative to the float64 reference
(max |got - ref| / max |ref|) is at most 2x torch SDPA's own error in the same dtype on the same inputs, or
under a floor (1e-6 fp32, 1e-3 half): sequence parallelism adds no error beyond the kernel's. torch SDPA runs
with enable_gqa (dense) or a boolean document mask (packed). Cases: GQA 32/8 and 16/4, MHA 12/12, uneven
14/2, B = 2, packed documents (one of length 1), lengths not a multiple of the kernels' tiles.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import doc_ids

import seqpar
from seqpar.attention.kernel_choice import kernel_problem
from seqpar.attention.kernels import default_scale, get_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [  # (B, S, Hq, Hkv, D, cu_seqlens)
    (2, 1000, 16, 4, 128, None),
    (1, 2048, 32, 8, 128, None),
    (1, 777, 12, 12, 64, None),
    (1, 1500, 14, 2, 64, [0, 700, 701, 1500]),
    (1, 3000, 32, 8, 128, [0, 1, 999, 2500, 3000]),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: torch SDPA's GQA path is the math kernel, so it is held to "within 1e-5 of float64"
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _mask(s, cu, dev):
    m = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    if cu:
        ids = doc_ids(s, cu).to(dev)
        m &= ids[:, None] == ids[None, :]
    return m


def _reference(q, k, v, cu):
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    sc = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    sc = sc.masked_fill(~_mask(q.shape[1], cu, q.device), float("-inf"))
    return (sc.softmax(-1) @ vh).transpose(1, 2)


def _torch_sdpa(q, k, v, cu):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    if cu:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_mask(q.shape[1], cu, q.device),
                                              enable_gqa=gqa).transpose(1, 2)
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa).transpose(1, 2)


def _grads(fn, q, k, v, w, cu):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(qs, ks, vs, cu)
    (o.to(w.dtype) * w).sum().backward()
    return [o.detach(), qs.grad, ks.grad, vs.grad]


def _rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _inputs(b, s, hq, hkv, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g).to(dtype) for h in (hq, hkv, hkv))
    w = torch.randn(b, s, hq, d, device="cuda", generator=g, dtype=torch.float64)
    return q, k, v, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}S{c[1]}h{c[2]}/{c[3]}d{c[4]}{'packed' if c[5] else ''}")
def test_seqpar_attention_within_torch_sdpa_error(dtype, case):
    b, s, hq, hkv, d, cu = case
    q, k, v, w = _inputs(b, s, hq, hkv, d, dtype, s + hq)
    ref = _grads(_reference, q.double(), k.double(), v.double(), w, cu)
    sdpa = [_rel(x, r) for x, r in zip(_grads(_torch_sdpa, q, k, v, w, cu), ref)]
    mesh = seqpar.init_mesh(1)
    cap = torch.cuda.get_device_capability()
    bad = []
    for kernel in ("auto", "flash", "cudnn", "efficient"):
        if kernel != "auto" and kernel_problem(kernel, "cuda", dtype, d, cap) is not None:
            continue
        fn = lambda q_, k_, v_, c_, kn=kernel: seqpar.attention(q_, k_, v_, mesh, cu_seqlens=c_, kernel=kn)  # noqa: E731
        got = [_rel(x, r) for x, r in zip(_grads(fn, q, k, v, w, cu), ref)]
        if any(e > max(2 * t, FLOOR[dtype]) for e, t in zip(got, sdpa)):
            bad.append((kernel, got))
    assert not bad, f"torch SDPA's errors {sdpa}; over 2x: {bad}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flash_varlen_equals_dense_per_document(dtype):
    """One varlen call over packed documents == the dense kernel on each document (same kernel family)."""
    kern = get_kernel(torch.device("cuda"), "flash", dtype, 128)
    cu = (0, 1, 300, 301, 1024, 2048)
    q, k, v, _ = _inputs(1, 2048, 32, 8, 128, dtype, 7)
    out, lse = kern.varlen_forward(q[0], k[0], v[0], cu, cu, 1024, 1024, True, default_scale(128))
    do = torch.randn_like(out)
    dq, dk, dv = kern.varlen_backward(do, q[0], k[0], v[0], out, lse, cu, cu, 1024, 1024, True, default_scale(128))
    for a, b in zip(cu, cu[1:]):
        sl = slice(a, b)
        o, l_ = kern.forward(q[:, sl], k[:, sl], v[:, sl], True, default_scale(128))
        g = kern.backward(do[None, sl], q[:, sl], k[:, sl], v[:, sl], o, l_, True, default_scale(128))
        # the same math in another tile order: a few half-precision roundings apart
        torch.testing.assert_close(out[sl].float(), o[0].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[sl], l_[0], atol=1e-4, rtol=1e-4)
        for got, want in zip((dq[sl], dk[sl], dv[sl]), g):
            torch.testing.assert_close(got.float(), want[0].float(), atol=3e-2, rtol=3e-2)


def test_auto_kernel_on_this_gpu():
    cap = torch.cuda.get_device_capability()
    want = "cudnn" if cap >= (9, 0) and torch.backends.cudnn.version() >= 90000 else \
        "flash" if cap >= (8, 0) else "efficient"
    assert get_kernel(torch.device("cuda"), "auto", torch.bfloat16, 128).name == want
    assert get_kernel(torch.device("cuda"), "auto", torch.float32, 128).name == "efficient"


def _variant_reference(q, k, v, window, sinks):
    """float64 causal attention with a sliding window and sinks as an extra logit column (gpt-oss's eager form)."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2)
    sc = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = q.shape[1]
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
    sc = sc.masked_fill(~((j <= i) & (i - j < window)), float("-inf"))
    col = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, s, 1).to(sc.dtype)
    return (torch.cat([sc, col], -1).softmax(-1)[..., :-1] @ vh).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_window_sinks_mla_on_every_kernel(dtype):
    """A 96-token window over 1000 tokens, sinks and a v head dim of 64 beside q / k's 128 (flash: its window;
    cuDNN: handed to flash; memory-efficient: math for the banded calls): out and q / k / v / sink gradients within
    the same relative error as torch SDPA's on the plain causal case of these shapes (or the floor)."""
    b, s, hq, hkv, d, dv, window = 1, 1000, 16, 4, 128, 64, 96
    q, k, _, _ = _inputs(b, s, hq, hkv, d, dtype, 11)
    g = torch.Generator(device="cuda").manual_seed(12)
    v = torch.randn(b, s, hkv, dv, device="cuda", generator=g).to(dtype)
    sinks = torch.randn(hq, device="cuda", generator=g)
    w = torch.randn(b, s, hq, dv, device="cuda", generator=g, dtype=torch.float64)

    def run(fn, q_, k_, v_, s_):
        ts = [t.detach().clone().requires_grad_() for t in (q_, k_, v_, s_)]
        o = fn(*ts)
        (o.to(w.dtype) * w).sum().backward()
        return [o.detach()] + [t.grad for t in ts]

    ref = run(lambda *t: _variant_reference(*t[:3], window, t[3]), q.double(), k.double(), v.double(), sinks.double())
    mesh = seqpar.init_mesh(1)
    cap = torch.cuda.get_device_capability()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    bad = []
    for kernel in ("auto", "flash", "cudnn", "efficient"):
        if kernel != "auto" and kernel_problem(kernel, "cuda", dtype, d, cap) is not None:
            continue
        fn = lambda q_, k_, v_, s_, kn=kernel: seqpar.attention(q_, k_, v_, mesh, kernel=kn, window=window,  # noqa: E731
                                                                 sinks=s_)
        got = [_rel(x, r) for x, r in zip(run(fn, q, k, v, sinks), ref)]
        if max(got) > tol:
            bad.append((kernel, got))
    assert not bad, bad
