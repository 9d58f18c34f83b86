"""Attention variants in every SP mode against an independent float64 reference on the full sequence: sliding
windows (shorter than a zigzag chunk, longer, longer than the sequence), attention sinks, MLA (v head dim other
than q/k's), combined with packed documents, B > 1, awkward head counts and odd P. Outputs and the gradients of
q, k, v and the sinks. fp32 tolerance 2e-5 (the suite's), as tests/test_attention.py."""

from __future__ import annotations

import pytest
import torch
from reference import doc_ids

import seqpar
from seqpar.attention import pieces as P
from seqpar.attention.kernels import CpuFlashKernel, MathKernel, VarlenByLoop
from seqpar.errors import SeqParError
from seqpar.threaded import run_threaded

TOL = 2e-5


def reference(q, k, v, cu=None, window=None, sinks=None, scale=None):
    """float64 softmax attention, causal, with documents, a sliding window and sinks written out as a mask and an
    extra logit column (transformers' eager gpt-oss form); GQA by repeating kv heads."""
    q, k, v = (t.double() for t in (q, k, v))
    b, s, h, d = q.shape
    g = h // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d**-0.5 if scale is None else scale)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j < window)
    ids = doc_ids(s, cu)
    allowed = allowed & (ids[:, None] == ids[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.double().view(1, h, 1, 1).expand(b, h, s, 1)
        probs = torch.cat([scores, col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def run_variant(mesh, hq, hkv, b, s, d=16, dv=None, cu=None, window=None, sinks=False, seed=0, **kw):
    """Max errors (out, dq, dk, dv, dsinks) of seqpar vs the reference on this mesh."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q, k = torch.randn(b, s, hq, d, generator=g), torch.randn(b, s, hkv, d, generator=g)
    v, do = torch.randn(b, s, hkv, dv, generator=g), torch.randn(b, s, hq, dv, generator=g)
    sk = torch.randn(hq, generator=g) if sinks else None
    ql, kl, vl = (seqpar.shard(t, mesh, 1).clone().requires_grad_() for t in (q, k, v))
    skl = sk.clone().requires_grad_() if sinks else None
    out = seqpar.attention(ql, kl, vl, mesh, cu_seqlens=cu, window=window, sinks=skl, **kw)
    out.backward(seqpar.shard(do, mesh, 1))
    got = [seqpar.unshard(t.detach(), mesh, 1).double() for t in (out, ql.grad, kl.grad, vl.grad)]
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    skr = sk.double().requires_grad_() if sinks else None
    ref = reference(qr, kr, vr, cu, window, skr)
    ref.backward(do.double())
    want = [ref.detach(), qr.grad, kr.grad, vr.grad]
    errs = [float((a - w).abs().max()) for a, w in zip(got, want)]
    if sinks:  # this rank's part of the sinks' gradient: the SP sum of the parts is the gradient
        part = skl.grad.double().clone()
        torch.distributed.all_reduce(part, group=mesh.sp_group)
        errs.append(float((part - skr.grad).abs().max()))
    return errs


CASES = [  # (hq, hkv, b, s, dv, cu, window, sinks)
    (4, 2, 1, 48, None, None, 5, False),  # window inside a zigzag chunk
    (4, 2, 2, 48, None, None, 13, False),  # window across chunks, B = 2
    (6, 2, 1, 48, None, [0, 7, 30, 31, 48], 9, False),  # packed documents and a window
    (4, 2, 1, 48, None, None, 64, False),  # window longer than the sequence: full causal
    (9, 3, 1, 48, None, None, None, True),  # sinks, heads not divisible
    (4, 1, 2, 48, None, [0, 20, 48], 6, True),  # sinks + window + documents (B = 1 docs below)
    (4, 2, 1, 48, 8, None, None, False),  # MLA: v head dim 8 < q/k 16
    (4, 2, 1, 48, 24, [0, 17, 48], 11, True),  # v head dim 24 > q/k 16, every variant at once
]


def _grid(sp, modes):
    res = []
    for u, r in modes:
        mesh = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        for i, (hq, hkv, b, s, dv, cu, window, sinks) in enumerate(CASES):
            if cu is not None:
                b = 1
            res.append(((u, r, i), run_variant(mesh, hq, hkv, b, s, dv=dv, cu=cu, window=window, sinks=sinks,
                                               seed=i)))
    return res


def _check(results):
    bad = [(key, e) for rank in results for key, e in rank if max(e) > TOL]
    assert not bad, bad[:10]


def test_variants_world2():
    _check(run_threaded(_grid, 2, 2, [(2, 1), (1, 2)], timeout=300))


def test_variants_world1():
    _check(run_threaded(_grid, 1, 1, [(1, 1)], timeout=300))


def test_variants_world4_usp_and_ring():
    _check(run_threaded(_grid, 4, 4, [(2, 2), (1, 4)], timeout=400))


def test_variants_world3():
    _check(run_threaded(_grid, 3, 3, [(3, 1), (1, 3)], timeout=400))


# ------------------------------------------------------------------------------------ the plan, without tensors
def _visible(p):
    lo, hi = p.band if p.band is not None else (0 if p.causal else -10**9, 10**9)
    return {(p.q0 + a, p.k0 + c) for a in range(p.q1 - p.q0) for c in range(p.k1 - p.k0) if lo <= a - c <= hi}


def _local_pairs(segs):
    out, off = [], 0
    for g, n in segs:
        out += [g + i for i in range(n)]
        off += n
    return out


@pytest.mark.parametrize("window", [1, 3, 8, 20, 1000])
@pytest.mark.parametrize("tile", [None, 4, 7])
def test_window_pieces_cover_exactly_the_mask(window, tile):
    """Every (q, k) pair the window and documents allow is in exactly one piece, no other pair is, and no piece
    has a row that sees nothing (the kernels never get a fully-masked row): zigzag ring blocks and a local row."""
    from seqpar.layout import ring_segments

    s, bounds = 48, [7, 30, 31]
    doc = doc_ids(s, [0, *bounds, s])
    cases = [([(0, s)], [(0, s)])]
    segs = [ring_segments(s, 3, j, "zigzag") for j in range(3)]
    cases += [(segs[a], segs[b]) for a in range(3) for b in range(3)]
    for q_segs, kv_segs in cases:
        qpos, kpos = _local_pairs(q_segs), _local_pairs(kv_segs)
        seen: list[tuple[int, int]] = []
        for p in P.plan_pieces(q_segs, kv_segs, True, bounds, window, tile):
            pairs = _visible(p)
            rows = {a for a, _ in pairs}
            assert rows == set(range(p.q0, p.q1)), f"a row of {p} sees nothing"
            seen += [(qpos[a], kpos[c]) for a, c in pairs]
        assert len(seen) == len(set(seen)), "a pair computed twice"
        want = {(i, j) for i in qpos for j in kpos if j <= i and i - j < window and doc[i] == doc[j]}
        assert set(seen) == want


def test_ring_computes_only_blocks_within_reach():
    """S = 4096 over ring 8 (zigzag chunks of 256), window 64: the work each rank's plan computes is what the
    window lets through (plus at most the tiles' rectangles), and most (q block, kv block) pairs have no call."""
    from seqpar.layout import ring_segments

    s, r, w = 4096, 8, 64
    segs = [ring_segments(s, r, j, "zigzag") for j in range(r)]
    kernel = CpuFlashKernel()
    for me in range(r):
        calls = [P.plan_calls(segs[me], segs[j], True, None, False, w, 64) for j in range(r)]
        busy = [j for j in range(r) if calls[j]]
        assert len(busy) <= 3, busy  # own block, and the blocks holding the chunks just before its two chunks
        area = sum((p.q1 - p.q0) * (p.k1 - p.k0) for c in calls for call in c for p in call.pieces)
        need = sum(P.visible_pairs(p) for c in calls for call in c for p in call.pieces)
        assert need == sum(min(i + 1, w) for i in _local_pairs(segs[me]))
        assert area <= 2.1 * need  # tiles of 64 rows see at most 64 + 63 keys each
    assert P.plan_calls(segs[0], segs[4], True, None, False, w, 64) == ()
    assert kernel.name == "cpu"


def test_band_kernels_agree_with_math():
    """The CPU flash op with a band mask, the math kernel and the varlen loop: the same out / lse / grads."""
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, n, h, 8, generator=g, dtype=torch.float64) for n, h in
                   ((9, 4), (13, 2), (13, 2), (9, 4)))
    band = (-4, 3)
    ref = MathKernel()
    o_r, l_r = ref.forward(q, k, v, False, 0.3, band)
    g_r = ref.backward(do, q, k, v, o_r, l_r, False, 0.3, band)
    for kern in (CpuFlashKernel(), VarlenByLoop(CpuFlashKernel())):
        for dt, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            args = [t.to(dt) for t in (q, k, v)]
            o, lse = kern.forward(*args, False, 0.3, band)
            grads = kern.backward(do.to(dt), *args, o, lse, False, 0.3, band)
            assert (o.double() - o_r).abs().max() < tol and (lse.double() - l_r).abs().max() < tol
            assert all((a.double() - b).abs().max() < tol for a, b in zip(grads, g_r))


@pytest.mark.parametrize("bad,msg", [(0, "positive int"), (2.5, "positive int"), (True, "positive int")])
def test_bad_window_refused(bad, msg):
    mesh = seqpar.init_mesh(1)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(SeqParError, match=msg):
        seqpar.attention(q, q, q, mesh, window=bad)


def test_bad_sinks_refused():
    mesh = seqpar.init_mesh(1)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(SeqParError, match=r"shape \[2\]"):
        seqpar.attention(q, q, q, mesh, sinks=torch.zeros(3))
    with pytest.raises(SeqParError, match="causal"):
        seqpar.attention(q, q, q, mesh, causal=False, window=4)


class _Counting(CpuFlashKernel):
    """The CPU kernel, counting the (q, k) rectangle area its forward calls compute."""

    def __init__(self):
        self.area = 0

    def forward(self, q, k, v, causal, scale, band=None):
        self.area += q.shape[1] * k.shape[1]
        return super().forward(q, k, v, causal, scale, band)


def _counted_ring(window):
    mesh = seqpar.init_mesh(4, ulysses_degree=1, ring_degree=4)
    kern = _Counting()
    errs = run_variant(mesh, 2, 1, 1, 1024, d=8, window=window, kernel=kern)
    return errs, kern.area


def test_ring_run_computes_only_what_the_window_reaches():
    """Ring 4 over S = 1024 (zigzag chunks of 128) with a 16-token window: exact, and each rank's forward kernel
    calls cover at most 2.1 x (its queries x 16) pairs, against 1/4 of the causal S^2 / 2 without the window."""
    res = run_threaded(_counted_ring, 4, 16, timeout=200)
    full = run_threaded(_counted_ring, 4, None, timeout=200)
    for (errs, area), (errs_full, area_full) in zip(res, full):
        assert max(errs) < TOL and max(errs_full) < TOL
        assert area <= 2.1 * 256 * 64 + 64 * 64  # 256 local queries, tiles of 64 rows reaching 64 + 15 keys
        assert area_full >= 1024 * 1024 / 2 / 4 * 0.9


def _chunked_kernels():
    """Head chunks (every mode's kernel calls per group of heads) and Ulysses overlap chunks with a window, sinks and
    Dv != D; the same boundaries in B = 2 rows (cu_seqlens with B > 1, as Llama 4's chunks use it)."""
    res = []
    for u, r in ((2, 1), (1, 2)):
        mesh = seqpar.init_mesh(2, ulysses_degree=u, ring_degree=r)
        res.append(((u, r, "head_chunks"), run_variant(mesh, 8, 4, 1, 48, dv=8, cu=[0, 20, 48], window=7, sinks=True,
                                                       head_chunks=3)))
        res.append(((u, r, "b2_cu"), run_variant(mesh, 4, 2, 2, 48, cu=[0, 12, 24, 36, 48], window=5, sinks=True)))
    mesh = seqpar.init_mesh(2, ulysses_degree=2)
    res.append(((2, 1, "overlap"), run_variant(mesh, 8, 4, 2, 48, window=9, sinks=True, overlap_chunks=2)))
    return res


def test_variants_with_head_and_overlap_chunks():
    _check(run_threaded(_chunked_kernels, 2, timeout=200))
