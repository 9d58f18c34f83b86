"""Kernel-call planning (attention.pieces.plan_calls) and the varlen call paths, exact on CPU.

The varlen paths (several pieces in one kernel call: what CUDA's flash kernel runs for packed documents) run
here through `VarlenByLoop(CpuFlashKernel())`, which gives the CPU kernel a varlen form; every SP mode is
compared (out, dq, dk, dv) with tests/reference.py (float64 math on the full sequence), fp32 tolerance 2e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import FP32_TOL, _all_ranks_agree, _check, run_case

import seqpar
from seqpar.attention.kernels import CpuFlashKernel, VarlenByLoop
from seqpar.attention.local import local_calls
from seqpar.attention.pieces import plan_calls, plan_pieces
from seqpar.layout import ring_segments
from seqpar.threaded import run_threaded

VARLEN = VarlenByLoop(CpuFlashKernel())


def _bounds(draw_cuts, s):
    return sorted({c for c in draw_cuts if 0 < c < s})


@settings(max_examples=80, deadline=None)
@given(ring=st.integers(1, 4), chunk=st.integers(1, 6), cuts=st.lists(st.integers(0, 48), max_size=8),
       causal=st.booleans(), layout=st.sampled_from(["zigzag", "contiguous"]))
def test_calls_run_every_piece_once_with_disjoint_rows(ring, chunk, cuts, causal, layout):
    s = 2 * ring * chunk
    bounds = _bounds(cuts, s) or None
    segs = [ring_segments(s, ring, r, layout) for r in range(ring)]
    for r in range(ring):
        for j in range(ring):
            pieces = plan_pieces(segs[r], segs[j], causal, bounds)
            calls = plan_calls(segs[r], segs[j], causal, bounds, True)
            got = [p for c in calls for p in c.pieces]
            assert sorted(got, key=str) == sorted(pieces, key=str)
            for c in calls:
                assert all(p.causal == c.causal for p in c.pieces)
                rows = c.q_ranges
                assert all(a[1] <= b[0] for a, b in zip(rows, rows[1:])), "a q row twice in one call"
                assert c.cu_q[-1] == sum(b - a for a, b in rows) and len(c.cu_q) == len(c.pieces) + 1
            assert len(plan_calls(segs[r], segs[j], causal, bounds, False)) == len(pieces)


def test_packed_row_is_one_call_in_a_world_of_one():
    bounds = list(range(2048, 131072, 2048))  # 64 documents of 2K tokens
    calls = local_calls(131072, True, bounds, VARLEN, batch=1)
    assert len(calls) == 1 and len(calls[0].pieces) == 64 and calls[0].covers(131072, 131072)
    assert len(local_calls(131072, True, bounds, CpuFlashKernel(), batch=1)) == 64  # no varlen form: per document
    assert len(local_calls(131072, True, bounds, VARLEN, batch=2)) == 64  # varlen packs one row only


def test_zigzag_step_with_many_documents_is_at_most_two_calls():
    s, ring = 4096, 4
    bounds = list(range(64, s, 64))
    segs = [ring_segments(s, ring, r, "zigzag") for r in range(ring)]
    for r in range(ring):
        for j in range(ring):
            calls = plan_calls(segs[r], segs[j], True, bounds, True)
            assert len(calls) <= 2 and len(plan_pieces(segs[r], segs[j], True, bounds)) >= len(calls)


def test_world1_local_paths_exact():
    mesh = seqpar.init_mesh(1)
    cases = []
    for kern in ("auto", VARLEN):
        for hq, hkv in ((14, 2), (4, 4), (6, 3)):
            for causal in (True, False):
                for b, cu in ((1, None), (2, None), (1, [0, 1, 9, 10, 33, 40]), (1, [0, 40])):
                    errs = run_case(mesh, hq, hkv, causal, b, 40, cu=cu, kernel=kern)
                    cases.append(((str(kern), hq, hkv, causal, b, str(cu), "float32"), errs))
    _check(cases)


def test_world1_direct_call_returns_the_kernel_output():
    """No documents: one kernel call, nothing merged or copied (out is what the kernel returned)."""
    calls_seen = []

    class Spy(CpuFlashKernel):
        def forward(self, q, k, v, causal, scale):
            res = super().forward(q, k, v, causal, scale)
            calls_seen.append(res[0])
            return res

    mesh = seqpar.init_mesh(1)
    q = torch.randn(1, 32, 4, 8, requires_grad=True)
    k = torch.randn(1, 32, 2, 8, requires_grad=True)
    out = seqpar.attention(q, k, k, mesh, kernel=Spy())
    assert len(calls_seen) == 1 and out.data_ptr() == calls_seen[0].data_ptr()


def _varlen_grid(sp, modes, heads, s, cus):
    results = []
    for u, r, layout in modes:
        mesh = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r, layout=layout)
        for hq, hkv in heads:
            for causal in (True, False):
                for cu in cus:
                    b = 2 if cu is None else 1
                    key = (u, r, layout, hq, hkv, causal, b, str(cu), "float32")
                    results.append((key, run_case(mesh, hq, hkv, causal, b, s, cu=cu, kernel=VARLEN)))
    return results


def varlen_world4():
    modes = [(4, 1, "zigzag"), (1, 4, "zigzag"), (1, 4, "contiguous"), (2, 2, "zigzag")]
    many = [0, *range(3, 64, 5), 64]  # 13 documents, most straddling shards and zigzag chunks
    return _varlen_grid(4, modes, [(14, 2), (6, 2)], 64, [many, [0, 5, 29, 30, 47, 64], None])


def varlen_world3():
    modes = [(3, 1, "zigzag"), (1, 3, "zigzag")]
    return _varlen_grid(3, modes, [(9, 3), (2, 1)], 48, [[0, *range(2, 48, 7), 48], None])


def test_varlen_calls_world4_all_modes():
    _check(_all_ranks_agree(run_threaded(varlen_world4, 4, timeout=400)))


def test_varlen_calls_world3_odd_degree():
    _check(_all_ranks_agree(run_threaded(varlen_world3, 3, timeout=300)))


@pytest.mark.parametrize("tol", [FP32_TOL])
def test_varlen_by_loop_matches_dense_per_sequence(tol):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, h, 8, generator=g) for h in (4, 2, 2))
    cu = (0, 7, 19, 30)
    out, lse = VARLEN.varlen_forward(q, k, v, cu, cu, 12, 12, True, 0.3)
    assert out.shape == q.shape and lse.shape == (30, 4)
    for a, b in zip(cu, cu[1:]):
        o, l_ = CpuFlashKernel().forward(q[None, a:b], k[None, a:b], v[None, a:b], True, 0.3)
        assert torch.allclose(out[a:b], o[0], atol=tol) and torch.allclose(lse[a:b], l_[0], atol=tol)
