"""`python -m seqpar.bench attention --peers`: the side-by-side part, without the optional peer installed.

yunchang is an optional extra (`seqpar[peers]`) that `make test` does not install: its adapters' own logic is
checked here on the CPU kernel (their contracts are flash_attn's, which yunchang calls), and the benchmark runs
with torch's context parallel (shipped with torch) while yunchang is reported missing. Exactness tolerance of
the adapters: 1e-5 against torch's SDPA / the float64 reference.
"""

from __future__ import annotations

import json

import pytest
import torch

from seqpar.bench.__main__ import main
from seqpar.bench.attention import peer_adapters as pa
from seqpar.errors import SeqParError


def _qkv(s=64, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, h, d, generator=g) for h in (hq, hkv, hkv, hq)]


def _sdpa(q, k, v, scale):
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def test_flash_attn_func_adapter_matches_sdpa():
    """yunchang's Ulysses calls attn_fn like flash_attn_func: q, k, v [B, S, H, D] (GQA) -> out, differentiable."""
    q, k, v, do = _qkv()
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    b = [t.clone().requires_grad_() for t in (q, k, v)]
    out = pa.cpu_flash_attn_func(*a, dropout_p=0.0, softmax_scale=0.3, causal=True, window_size=(-1, -1))
    ref = _sdpa(*b, 0.3)
    out.backward(do)
    ref.backward(do)
    for x, y in zip((out, *(t.grad for t in a)), (ref, *(t.grad for t in b))):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="dropout"):
        pa.cpu_flash_attn_func(q, k, v, dropout_p=0.1)


def test_forward_backward_entries_follow_flash_attn_layout():
    """The ring's entries: lse comes out [B, H, S] (flash_attn's), goes back in that way, and the gradients land in
    the caller's buffers (views of a larger buffer, as yunchang passes dq_buffer[:, :seqlen])."""
    q, k, v, do = _qkv()
    out, lse = pa.cpu_flash_forward(q, k, v, 0.0, 0.3, causal=True)
    assert lse.shape == (1, 4, 64) and lse.dtype == torch.float32
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _sdpa(*ref, 0.3)
    want.backward(do)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-5)
    bufs = [torch.full((1, 80, t.shape[2], 16), float("nan")) for t in (q, k, v)]
    pa.cpu_flash_backward(do, q, k, v, out, lse, *(b[:, :64] for b in bufs), 0.0, 0.3, True, (-1, -1), 0.0, None,
                          False, None)
    for b, r in zip(bufs, ref):
        torch.testing.assert_close(b[:, :64], r.grad, rtol=0, atol=1e-5)
        assert torch.isnan(b[:, 64:]).all()  # nothing written past the view
    pa._KERNEL_BUFFERS.clear()


def test_upcast_copies_only_the_kernel_buffers():
    """`buf.to(torch.float32)` of a buffer the backward entry wrote copies (as bf16 -> fp32 does), so an accumulator
    taken that way survives the next kernel call; every other tensor's .to stays as torch has it."""
    q, k, v, do = _qkv()
    out, lse = pa.cpu_flash_forward(q, k, v, 0.0, 0.3, causal=True)
    bufs = [torch.empty_like(t) for t in (q, k, v)]
    pa.cpu_flash_backward(do, q, k, v, out, lse, *bufs, 0.0, 0.3, True)
    other = torch.ones(3)
    with pa.UpcastCopies():
        acc = bufs[0].to(torch.float32)
        same = other.to(torch.float32)
    assert acc.data_ptr() != bufs[0].data_ptr() and torch.equal(acc, bufs[0])
    assert same is other
    pa._KERNEL_BUFFERS.clear()
    with pa.UpcastCopies():
        assert bufs[0].to(torch.float32) is bufs[0]  # not registered any more


def test_torch_cp_adapter_and_missing_yunchang(tmp_path, monkeypatch, capsys):
    """`--peers` (all) on a machine without yunchang: torch context parallel's ring (both rotations) beside seqpar's
    modes on the same shards, exact vs float64; yunchang reported missing in the summary and the JSON; the PNG."""
    monkeypatch.setattr(pa, "yunchang_available", lambda: False)
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    assert main(["attention", "--peers", "--peer-cases", "128:2:4:4:16,128:4:4:2:16", "--reps", "1",
                 "--out", str(out), "--png", str(png), "--timeout", "240"]) == 0
    assert "yunchang is not installed (pip install 'seqpar[peers]')" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["missing_peers"] == ["yunchang"] and res["side_by_side"]["versions"]["yunchang"] is None
    assert png.stat().st_size > 10_000
    cases = res["side_by_side"]["cases"]
    assert [c["label"] for c in cases] == ["S=128 P=2 4/4 heads D=16", "S=128 P=4 4/2 heads D=16"]
    for c in cases:
        names = {"seqpar_ulysses", "seqpar_ring", "torch_cp_allgather", "torch_cp_alltoall"}
        names |= {"seqpar_usp"} if c["case"]["sp"] == 4 else set()
        assert set(c["results"]) == names
        for name, r in c["results"].items():
            assert r["refused"] is None and r["max_abs_err"] < 1e-5, (c["label"], name, r)
            assert r["peak_bytes"] > 0 and r["checkpointed_peak_bytes"] > 0 and len(r["cpu_s"]) == 1
        assert set(c["ratios"]) == {"seqpar_ring/torch_cp_allgather", "seqpar_ring/torch_cp_alltoall"}


def test_explicit_peer_that_is_missing_is_refused(monkeypatch):
    monkeypatch.setattr(pa, "yunchang_available", lambda: False)
    with pytest.raises(SeqParError, match=r"pip install 'seqpar\[peers\]'"):
        main(["attention", "--peers", "yunchang", "--quick"])
    with pytest.raises(SeqParError, match="use auto, deepspeed, none"):
        main(["attention", "--peers", "megatron", "--quick"])
