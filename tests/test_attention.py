"""Multi-rank exactness of seqpar.attention: every mode, awkward head counts, packing, B>1, dtypes.

Each test runs ONE world and a grid of cases in it; every case compares the output and dq/dk/dv (gathered with
seqpar.unshard) against tests/reference.py (float64 math on the full sequence). The grids run their ranks as
threads of this process (seqpar.threaded: bitwise what gloo processes give, tests/test_threaded.py); the dtype
grid, the bad-input refusals and the fused-call counts run in gloo processes.
Tolerances: fp32 inputs 2e-5 absolute; bf16 4e-2 (out) / 1e-1 (grads); fp16 5e-3 / 1e-2 (see DTYPE_TOL).
"""

from __future__ import annotations

import pytest
import torch
from reference import reference_attention

import seqpar
from seqpar.spawn import run_distributed
from seqpar.threaded import run_threaded

FP32_TOL = 2e-5
DTYPE_TOL = {torch.float32: (FP32_TOL, FP32_TOL), torch.bfloat16: (4e-2, 1e-1), torch.float16: (5e-3, 1e-2)}


def _inputs(seed, b, s, hq, hkv, d):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv, hq)]  # q, k, v, dout


def run_case(mesh, hq, hkv, causal, b, s, d=16, cu=None, dtype=torch.float32, seed=0, scale=None, **kw):
    """Errors (out, dq, dk, dv) of seqpar vs the float64 reference, for one case on this mesh
    (kw: more seqpar.attention arguments, e.g. overlap_chunks)."""
    q, k, v, do = _inputs(seed + mesh.dp_rank, b, s, hq, hkv, d)
    ql, kl, vl = (seqpar.shard(t, mesh, 1).to(dtype).clone().requires_grad_() for t in (q, k, v))
    out = seqpar.attention(ql, kl, vl, mesh, causal=causal, cu_seqlens=cu, softmax_scale=scale, **kw)
    assert out.dtype == dtype and out.shape == ql.shape
    out.backward(seqpar.shard(do, mesh, 1).to(dtype))
    for t in (ql, kl, vl):
        assert t.grad.dtype == dtype, "gradients must come back in the input dtype"
    got = [seqpar.unshard(t.detach(), mesh, 1).double() for t in (out, ql.grad, kl.grad, vl.grad)]
    qr, kr, vr = (t.to(dtype).double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal, cu, scale)
    ref.backward(do.to(dtype).double())
    want = [ref, qr.grad, kr.grad, vr.grad]
    assert all(torch.isfinite(x).all() for x in got), "NaN/inf in seqpar output or gradients"
    return [float((a - w).abs().max()) for a, w in zip(got, want)]


HEADS_4 = [(14, 2), (9, 3), (8, 8), (4, 1), (6, 2)]  # Qwen2.5-0.5B, SmolLM2, MHA, kv<P, Hq%P!=0
MODES_4 = [(4, 1, "zigzag"), (1, 4, "zigzag"), (1, 4, "contiguous"), (2, 2, "zigzag"), (2, 2, "contiguous")]


def _grid(sp, modes, heads, s_unpacked, s_packed, cu, dtypes=(torch.float32,), bs=(1, 2)):
    results = []
    for u, r, layout in modes:
        mesh = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r, layout=layout)
        for hq, hkv in heads:
            for causal in (True, False):
                for b in bs:
                    for dtype in dtypes:
                        key = (u, r, layout, hq, hkv, causal, b, "unpacked", str(dtype))
                        results.append((key, run_case(mesh, hq, hkv, causal, b, s_unpacked, dtype=dtype)))
                key = (u, r, layout, hq, hkv, causal, 1, "packed", "float32")
                results.append((key, run_case(mesh, hq, hkv, causal, 1, s_packed, cu=cu)))
    return results


def world4_grid():
    # S=48: not a multiple of the zigzag chunk grid boundaries of the docs; docs straddle shards.
    return _grid(4, MODES_4, HEADS_4, 48, 64, [0, 5, 29, 30, 47, 64])


def world2_grid():
    modes = [(2, 1, "zigzag"), (1, 2, "zigzag"), (1, 2, "contiguous")]
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return _grid(2, modes, [(9, 3), (14, 2), (3, 3)], 36, 40, [0, 1, 13, 40], dtypes=dtypes)


def world3_grid():
    modes = [(3, 1, "zigzag"), (1, 3, "zigzag"), (1, 3, "contiguous")]
    return _grid(3, modes, [(9, 3), (14, 2), (4, 4), (2, 1)], 42, 48, [0, 10, 11, 30, 48])


def world6_grid():
    modes = [(3, 2, "zigzag"), (2, 3, "zigzag"), (6, 1, "zigzag"), (1, 6, "zigzag")]
    return _grid(6, modes, [(14, 2), (9, 3), (12, 4)], 48, 72, [0, 7, 40, 41, 72], bs=(2,))


def world8_grid():
    modes = [(8, 1, "zigzag"), (4, 2, "zigzag"), (2, 4, "zigzag")]
    # (6, 6) at ulysses 4: rank_heads gives Ulysses rank 3 no heads at all (its ring skips, the exchanges run)
    return _grid(8, modes, [(28, 4), (32, 8), (6, 6), (14, 2)], 64, 64, [0, 9, 33, 64], bs=(1,))


def _check(results, dtype_tol=DTYPE_TOL):
    bad = []
    for key, errs in results:
        dtype = getattr(torch, key[-1].split(".")[-1])
        tol_out, tol_grad = dtype_tol[dtype]
        if errs[0] > tol_out or max(errs[1:]) > tol_grad:
            bad.append((key, errs))
    assert not bad, f"{len(bad)} of {len(results)} cases exceed tolerance:\n" + "\n".join(map(str, bad[:20]))


def _all_ranks_agree(res):
    # every rank must have checked the same cases; check all ranks' errors
    return [case for rank_res in res for case in rank_res]


def test_attention_world4_all_modes():
    _check(_all_ranks_agree(run_threaded(world4_grid, 4, timeout=400)))


def test_attention_world2_dtypes():
    _check(_all_ranks_agree(run_distributed(world2_grid, 2, timeout=300)))


def test_attention_world3_odd_degree():
    _check(_all_ranks_agree(run_threaded(world3_grid, 3, timeout=300)))


@pytest.mark.slow
def test_attention_world6_usp_3x2_2x3():
    _check(_all_ranks_agree(run_threaded(world6_grid, 6, timeout=540)))


@pytest.mark.slow
def test_attention_world8_big_head_configs():
    _check(_all_ranks_agree(run_threaded(world8_grid, 8, timeout=540)))


def world6_fast():
    mesh = seqpar.init_mesh(6, ulysses_degree=3, ring_degree=2)
    res = [(("3x2", 14, 2, True), run_case(mesh, 14, 2, True, 1, 48, cu=[0, 7, 40, 48]))]
    mesh = seqpar.init_mesh(6, ulysses_degree=2, ring_degree=3)
    res.append((("2x3", 9, 3, True), run_case(mesh, 9, 3, True, 2, 48)))
    return [(k + ("float32",), e) for k, e in res]


def test_attention_usp_3x2_and_2x3_fast():
    _check(_all_ranks_agree(run_threaded(world6_fast, 6, timeout=300)))


def world16_case():
    mesh = seqpar.init_mesh(16, ulysses_degree=8, ring_degree=2)
    return [(("8x2", 32, 8, True, "float32"), run_case(mesh, 32, 8, True, 1, 64, cu=[0, 20, 64]))]


@pytest.mark.slow
def test_attention_world16_32q_8kv_ring2():
    _check(_all_ranks_agree(run_threaded(world16_case, 16, timeout=540)))


def world16_fast():
    """The fast twin of the world-8 and world-16 tests in ONE world of 16: the world-16 case (ulysses 8 x ring 2),
    then each world-8 mesh as dp 2 x sp 8 (every SP group of 8 on its own rows) with its hardest head counts:
    (6, 6) at ulysses 4 leaves a Ulysses rank without heads, (28, 4) / (32, 8) the big GQA configs."""
    res = world16_case()
    for u, r, heads in ((4, 2, [(6, 6), (28, 4)]), (8, 1, [(32, 8)]), (2, 4, [(14, 2)])):
        mesh = seqpar.init_mesh(8, ulysses_degree=u, ring_degree=r)
        assert mesh.dp_size == 2
        for hq, hkv in heads:
            key = (u, r, "zigzag", hq, hkv, True, 1, "packed", "float32")
            res.append((key, run_case(mesh, hq, hkv, True, 1, 64, cu=[0, 9, 33, 64])))
    return res


def test_attention_world8_and_world16_fast():
    res = _all_ranks_agree(run_threaded(world16_fast, 16, timeout=400))
    assert len(res) == 16 * 5
    _check(res)


def dp_sp_world():
    """dp=2 x sp=2: each SP group works on its own data; the group {2,3} lacks global rank 0."""
    out = []
    for u, r in ((2, 1), (1, 2)):
        mesh = seqpar.init_mesh(2, ulysses_degree=u, ring_degree=r)
        assert mesh.dp_size == 2
        errs = run_case(mesh, 6, 2, True, 2, 40, seed=10)
        # unshard's backward (sum reduce-scatter) on a subgroup without global rank 0
        x = torch.randn(1, 40 // 2, 3, generator=torch.Generator().manual_seed(mesh.sp_rank)).requires_grad_()
        full = seqpar.unshard(x, mesh, 1)
        (full * torch.arange(40.0).view(1, 40, 1)).sum().backward()
        expect = 2.0 * seqpar.shard(torch.arange(40.0).view(1, 40, 1).expand(1, 40, 3), mesh, 1)
        errs.append(float((x.grad - expect).abs().max()))
        out.append(((u, r, mesh.dp_rank, "float32"), errs))
    return out


def test_attention_dp2_sp2_subgroups():
    res = _all_ranks_agree(run_threaded(dp_sp_world, 4, timeout=300))
    _check([(k, e[:4]) for k, e in res])
    assert all(e[4] == 0.0 for _, e in res), "unshard backward wrong on a subgroup"


def bad_input_world():
    """Bad input raises SeqParError on every rank before any collective (else this world would hang)."""
    mesh = seqpar.init_mesh(2, ulysses_degree=2)
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    msgs = []
    cases = [
        lambda: seqpar.attention(q, k, torch.randn(1, 8, 3, 8), mesh),  # v's heads differ (its head dim may: MLA)
        lambda: seqpar.attention(q, torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16), mesh),
        lambda: seqpar.attention(q[0], k[0], k[0], mesh),
        lambda: seqpar.attention(q, k, k, mesh, cu_seqlens=[0, 5, 15]),
        lambda: seqpar.attention(q, k, k, mesh, sinks=torch.zeros(3)),  # one sink per q head: 4
        lambda: seqpar.attention(q, k.double(), k, mesh),
        lambda: seqpar.shard(torch.randn(1, 7, 2), mesh, 1),
        lambda: seqpar.init_mesh(3),
        lambda: seqpar.init_mesh(2, ulysses_degree=2, ring_degree=2),
        lambda: seqpar.attention(q, k, k, mesh, overlap_chunks=2),  # 1 kv head per rank: cannot split in 2
        lambda: seqpar.attention(q, k, k, mesh, window=0),
    ]
    for c in cases:
        try:
            c()
            msgs.append(None)
        except seqpar.SeqParError as e:
            msgs.append(str(e))
    return msgs


def test_bad_input_raises_before_collectives():
    msgs = run_distributed(bad_input_world, 2, timeout=120)[0]
    assert all(m is not None for m in msgs), msgs
    assert "pad by 1 to 8" in msgs[6]
    assert "overlap_chunks=2" in msgs[9] and "divide" in msgs[9]
    assert "use one of 1, 2" in msgs[7]


# ----------------------------------------------------------------------------- fused exchange, overlap, ring bytes
@pytest.mark.parametrize("b", [1, 2])
def test_fused_pack_layout_by_hand(b):
    """The exchanges' buffers with the uneven all-to-all done by hand for P simulated ranks (14q/2kv at P=4:
    3 or 4 q heads per rank, the plan's dummies not sent): rank i gets the full sequence of exactly its
    `rank_heads` of q, k and v (sequence-major; for B == 1 the receive buffer itself, no copy), and the way
    back puts every head of every rank's output into its original place of the sequence shards."""
    from seqpar.attention import ulysses_fused as uf
    from seqpar.attention.ulysses import head_plan, rank_heads

    p, s, hq, hk, d = 4, 3, 14, 2, 5
    ranks = list(rank_heads(head_plan(hq, hk, p)))
    assert [len(r.q) for r in ranks] == [4, 3, 4, 3]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, p * s, h, d, generator=g) for h in (hq, hk, hk))
    shard = [[t[:, j * s : (j + 1) * s] for t in (q, k, v)] for j in range(p)]
    sends = [uf._pack_to_ranks([(sh[0], "q"), (sh[1], "kv"), (sh[2], "kv")], ranks) for sh in shard]
    heads_of = []
    for i, r in enumerate(ranks):
        recv = torch.cat([buf[sum(sizes[:i]) : sum(sizes[: i + 1])] for buf, sizes in sends])
        x = uf._even_recv(recv, p, b, s, d)
        assert x.is_contiguous() and (x.data_ptr() == recv.data_ptr()) == (b == 1)
        nq, nk = len(r.q), len(r.kv)
        torch.testing.assert_close(x[:, :, :nq], q[:, :, list(r.q)], rtol=0, atol=0)
        torch.testing.assert_close(x[:, :, nq : nq + nk], k[:, :, list(r.kv)], rtol=0, atol=0)
        torch.testing.assert_close(x[:, :, nq + nk :], v[:, :, list(r.kv)], rtol=0, atol=0)
        heads_of.append(x[:, :, :nq])
    # the way back: rank i's heads of the whole sequence -> every rank's sequence shard with all heads
    backs = [uf._pack_full_seq([h], p).view(-1) for h in heads_of]
    for j in range(p):
        recv = torch.cat([bk[j * bk.numel() // p : (j + 1) * bk.numel() // p] for bk in backs])
        out = torch.full((b, s, hq, d), float("nan"))
        sizes = [b * s * len(r.q) * d for r in ranks]
        for r, blk in zip(ranks, uf._blocks(recv, sizes, b, s, d)):
            uf._scatter(out, blk, r.q, add=False)
        torch.testing.assert_close(out, q[:, j * s : (j + 1) * s], rtol=0, atol=0)


def _overlap_cases(sp, heads, chunks, s):
    mesh = seqpar.init_mesh(sp, ulysses_degree=sp)
    out = []
    for hq, hkv in heads:
        for causal in (True, False):
            for b in (1, 2):
                mesh.stats.reset()
                errs = _run_chunked(mesh, hq, hkv, causal, b, s, chunks)
                calls = dict(mesh.stats.calls)
                out.append(((sp, hq, hkv, causal, b, chunks, "float32"), errs, calls))
        errs = _run_chunked(mesh, hq, hkv, True, 1, s, chunks, cu=[0, 3, s - 5, s])
        out.append(((sp, hq, hkv, "packed", 1, chunks, "float32"), errs, None))
    return out


def _run_chunked(mesh, hq, hkv, causal, b, s, chunks, cu=None):
    """run_case with overlap_chunks: the async head-chunked path vs the float64 reference."""
    return run_case(mesh, hq, hkv, causal, b, s, cu=cu, overlap_chunks=chunks)


def overlap_world2():
    res = _overlap_cases(2, [(8, 4), (12, 4), (4, 4)], 2, 24)  # 2 kv heads per rank -> 2 chunks
    res += _overlap_cases(2, [(9, 3)], 2, 24)  # plan 12q/4kv: the dummy kv group is a chunk of its own
    return res


def overlap_world3():
    return _overlap_cases(3, [(12, 6), (6, 6), (18, 6)], 2, 36)  # 2 kv heads per rank, GQA 3:1 / MHA


def _check_overlap(results, chunks):
    _check([(k, e) for k, e, _ in results])
    for key, _, calls in results:
        if calls is not None:  # every chunk: one all-to-all out and one back, per pass
            assert calls == {"ulysses_fwd": 2 * chunks, "ulysses_bwd": 2 * chunks, "all_gather": 4}, (key, calls)


def test_ulysses_fused_and_overlap_world2_fast():
    """Fast guard: the fused exchange issues 2 all-to-alls per pass, overlap_chunks=2 issues 4, both exact."""
    _check_overlap(_all_ranks_agree(run_threaded(overlap_world2, 2, timeout=200)), 2)


@pytest.mark.slow
def test_ulysses_overlap_world3():
    _check_overlap(_all_ranks_agree(run_threaded(overlap_world3, 3, timeout=300)), 2)


def fused_calls_world(sp):
    """Pure Ulysses (fused): 2 all-to-alls per pass; ring: dK/dV in R-1 hops (2 (R-1) sends of dK, dV)."""
    out = []
    for u, r in ((sp, 1), (1, sp)):
        mesh = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        mesh.stats.reset()
        errs = run_case(mesh, 6, 3, True, 1, 12 * sp)
        out.append(((u, r), errs, dict(mesh.stats.calls), dict(mesh.stats.bytes)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 3, 4])
def test_collective_counts_fused_ulysses_and_ring_r_minus_1(sp):
    from seqpar.attention.costs import ring_theory

    for (u, r), errs, calls, nbytes in run_distributed(fused_calls_world, sp, sp, timeout=300)[0]:
        assert max(errs) < FP32_TOL, errs
        if u > 1:
            assert calls["ulysses_fwd"] == calls["ulysses_bwd"] == 2, calls
        else:
            # K/V: 2 sends per hop, R-1 hops, fwd and bwd; dK/dV: 1 stacked send per hop, R-1 hops (not R)
            assert calls["ring_fwd"] == 2 * (r - 1) and calls["ring_bwd"] == 3 * (r - 1), calls
            th = ring_theory(12 * sp, 1, 3, 16, r, 4)
            assert nbytes["ring_bwd"] == th["bwd_min"] == th["bwd"], (nbytes, th)


def test_attention_submodules_import_as_names():
    """`seqpar.attention` is the function and the package: `import seqpar.attention.<module> as x` finds the
    submodule (a function attribute shadowed the package: ImportError), and the call still works."""
    import seqpar.attention.kernel_choice as kc
    import seqpar.attention.ring as ring

    assert kc.kernel_name_for("cpu", torch.float32) == "cpu" and callable(ring.ring_attention)
    q = torch.randn(1, 8, 2, 16)
    torch.testing.assert_close(seqpar.attention(q, q, q, seqpar.init_mesh(1)),
                               seqpar.attention.attention(q, q, q, seqpar.init_mesh(1)), rtol=0, atol=0)
