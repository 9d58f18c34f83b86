"""Pure Ulysses' per-rank peak memory, byte for byte, and the paths that must not free early.

The fused backward frees the saved output and lse (and writes the kernel's dq, dk, dv over the saved q/k/v exchange
buffer) before the gradient exchange, when autograd drops the graph after the call. The expected peaks are derived
tensor by tensor (docs/attention.md, "Ulysses' bytes"), with u = one [B, S/P, H, D] shard of all heads (= one
[B, S, H/P, D] head shard) and L = the kernel's fp32 lse of this rank's heads; the meter is exact (tolerance 0).
retain_graph keeps the saved tensors intact (a second backward gives the same gradients), and a checkpointed call
recomputes and frees the same way; both are compared against the float64 reference (2e-5, as tests/test_attention).
"""

from __future__ import annotations

import torch
from reference import reference_attention

import seqpar
from seqpar.attention.ulysses import head_plan
from seqpar.memory.meter import PeakMemoryMeter
from seqpar.spawn import run_distributed

TOL = 2e-5


def _shards(mesh, b, s, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv, hq)]
    return full, [seqpar.shard(t, mesh) for t in full]


def _peak(fn, repeats: int = 3) -> int:
    """The step's peak of live tensors: the least of a few runs. gloo's finished work can hold a send or receive
    buffer for a moment after wait() returns (its own thread drops it), which only ever adds bytes, at random."""
    peaks = []
    for _ in range(repeats):
        meter = PeakMemoryMeter(torch.nn.Module(), device="cpu")
        with meter.measure():
            fn()
        peaks.append(int(meter.last["peak_bytes"]))
    return min(peaks)


def peaks_world2():
    """Measured peaks (inputs, incoming gradient and input gradients made inside the measurement) for B = 1,
    8 / 8 heads at P = 2: plain, checkpointed and with retain_graph."""
    mesh = seqpar.init_mesh(2, ulysses_degree=2)
    s, hq, d = 256, 8, 16
    _, shards = _shards(mesh, 1, s, hq, hq, d)

    def step(checkpoint=False, retain=False):
        q, k, v, do = (t.clone() for t in shards)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        call = lambda q, k, v: seqpar.attention(q, k, v, mesh, kernel="cpu")  # noqa: E731
        out = torch.utils.checkpoint.checkpoint(call, q, k, v, use_reentrant=False) if checkpoint else call(q, k, v)
        out.backward(do, retain_graph=retain)

    return {"plain": _peak(step), "checkpointed": _peak(lambda: step(checkpoint=True)),
            "retained": _peak(lambda: step(retain=True)), "u": s // 2 * hq * d * 4, "lse": s * hq // 2 * 4}


def test_ulysses_peak_by_hand():
    """11 u + L on every rank. Moments (inputs q, k, v and dout: 4 u throughout): forward, q/k/v's exchange 3 u
    out + 3 u in (10 u), then x 3 u, the kernel's output 1 u + L, its way back 1 u and the sequence-space out 1 u
    (10 u + L); backward: dout's exchange 1 u out + 1 u in beside x, output, lse and out (11 u + L) <- the peak;
    the kernel one kv head at a time (3 u / 4 beside, 10.75 u + L); the output, lse and received dout freed, the
    exchange of x itself (now dq, dk, dv in head space) 3 u in (11 u); x freed, then dq, dk, dv 3 u (11 u).
    Before: 18 u + L at the last moment (saved x, output, lse, the packed send buffer, its receive buffer and
    dq, dk, dv all alive at once).
    Checkpointed: the recompute adds nothing beyond the same moments. retain_graph: nothing is freed early."""
    for r in run_distributed(peaks_world2, 2, timeout=200):
        u, lse = r["u"], r["lse"]
        assert r["plain"] == 11 * u + lse, r
        assert r["checkpointed"] == 11 * u + lse, r
        assert r["retained"] > r["plain"], r  # saved tensors kept: the kernel's gradients get a buffer of their own


def retain_and_checkpoint_world(sp):
    """Errors vs float64 of (1) two backwards through one graph (retain_graph=True, gradients summed: 2x), and
    (2) a checkpointed call, for B in {1, 2} and GQA / dummy-head plans (overlap_chunks 1 and, where the local kv
    heads split, 2)."""
    mesh = seqpar.init_mesh(sp, ulysses_degree=sp)
    out = []
    for hq, hkv, b in ((8, 8, 1), (6, 2, 2), (9, 3, 1), (8, 4, 1)):
        full, (q0, k0, v0, do) = _shards(mesh, b, 12 * sp, hq, hkv, 16, seed=hq + b)
        qr, kr, vr = (t.double().requires_grad_() for t in full[:3])
        ref = reference_attention(qr, kr, vr, True)
        ref.backward(full[3].double())
        want = [seqpar.shard(t, mesh) for t in (ref.detach(), qr.grad, kr.grad, vr.grad)]
        local_kv = head_plan(hq, hkv, sp).expanded_kv_heads // sp
        for chunks in sorted({1, 2 if local_kv % 2 == 0 else 1}):
            call = lambda q, k, v, c=chunks: seqpar.attention(q, k, v, mesh, overlap_chunks=c)  # noqa: E731
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            o = call(q, k, v)
            o.backward(do, retain_graph=True)
            o.backward(do)  # the saved tensors are intact: the sum of two equal gradients
            errs = [float((o.detach().double() - want[0]).abs().max())]
            errs += [float((t.grad.double() / 2 - w).abs().max()) for t, w in zip((q, k, v), want[1:])]
            out.append((("retain", hq, hkv, b, chunks), errs))
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            o = torch.utils.checkpoint.checkpoint(call, q, k, v, use_reentrant=False)
            o.backward(do)
            errs = [float((a.double() - w).abs().max()) for a, w in zip((o.detach(), q.grad, k.grad, v.grad), want)]
            out.append((("checkpoint", hq, hkv, b, chunks), errs))
    return out


def test_ulysses_retain_graph_and_checkpoint_exact():
    res = [case for rank in run_distributed(retain_and_checkpoint_world, 2, 2, timeout=200) for case in rank]
    res += [case for rank in run_distributed(retain_and_checkpoint_world, 3, 3, timeout=200) for case in rank]
    bad = [(key, errs) for key, errs in res if max(errs) > TOL]
    assert not bad and len(res) >= 20, bad
