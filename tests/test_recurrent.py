"""seqpar.recurrent: conv + linear recurrence over a ring with state passing, in float64, vs one process.

The reference runs the whole sequence on one process, row by row and document by document, with a causal depthwise
conv (F.conv1d, zero history at every document start) and the token-by-token float64 recurrences of
tests/recurrent_ref.py (gated delta rule; Mamba2 SSD; Mamba1's selective scan; the RG-LRU's diagonal recurrence), or
the conv alone (ring_conv). The
sharded run gives each ring rank its shard (seqpar.shard: zigzag or contiguous), runs
seqpar.recurrent.ring_recurrence with the same per-piece recurrences and compares the unsharded output and the
gradients of EVERY input (x, gates, step sizes: this rank's shard of the reference gradient; conv weight and SSD
parameters: summed over ranks) after backward of a fixed random weighting of the output. Tolerance: 1e-10 absolute
(float64; values O(1)).
Cases: ring 2 / 3 / 4, zigzag and contiguous, unpacked B=2 rows and packed rows whose documents start inside
shards, on shard seams and within the conv's kernel of a seam, chunks shorter than the conv kernel (S=12 at
ring 3 zigzag: 2-token chunks, the halo spans two chunks), both state-passing modes (chain, scan).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from recurrent_ref import naive_gated_delta, naive_rg_lru_scan, naive_selective_scan, naive_ssd

import seqpar
from seqpar.recurrent import (
    SelectiveParams,
    SSDParams,
    delta_piece,
    diagonal_piece,
    ring_conv,
    ring_plan,
    ring_recurrence,
    selective_piece,
    ssd_piece,
)
from seqpar.spawn import run_distributed
from seqpar.threaded import run_threaded

TOL = 1e-10
K = 4  # conv kernel
HK, DK, HV, DV = 2, 3, 4, 5  # delta rule: k heads, k dim, v heads, v dim
H, P, G, N = 4, 3, 2, 5  # SSD: heads, head dim, groups, state
D1, N1 = 4, 3  # Mamba1 selective scan: channels, state entries
TRANSITION = {"delta": "matrix", "ssd": "scalar", "selective": "diagonal", "rglru": "diagonal"}


def _conv(w: torch.Tensor, bias: torch.Tensor):
    def conv(x: torch.Tensor) -> torch.Tensor:  # [b, L, C] causal depthwise, zeros before x, then SiLU
        y = F.conv1d(x.transpose(1, 2), w[:, None, :], bias, padding=K - 1, groups=x.shape[-1])
        return F.silu(y[..., : x.shape[1]]).transpose(1, 2)
    return conv


def _inputs(kind: str, b: int, s: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    if kind == "delta":
        c = 2 * HK * DK + HV * DV
        return {"x": r(b, s, c), "beta": r(b, s, HV), "a": r(b, s, HV), "w": r(c, K, scale=0.5), "bias": r(c)}
    if kind == "rglru":  # h_t = a_t h_{t-1} + x_t per channel, log a_t = -softplus(.) (a in (0, 1))
        return {"x": r(b, s, D1), "a": r(b, s, D1), "w": r(D1, K, scale=0.5), "bias": r(D1)}
    if kind in ("selective", "conv"):
        return {"x": r(b, s, D1), "dt": r(b, s, D1), "bm": r(b, s, N1), "cm": r(b, s, N1), "z": r(b, s, D1),
                "w": r(D1, K, scale=0.5), "bias": r(D1), "a_log": r(D1, N1, scale=0.3), "dt_bias": r(D1, scale=0.3),
                "d": r(D1)}
    c = H * P + 2 * G * N
    return {"x": r(b, s, c), "dt": r(b, s, H), "w": r(c, K, scale=0.5), "bias": r(c), "a_log": r(H, scale=0.3),
            "dt_bias": r(H, scale=0.3), "d": r(H)}


def _piece_fn(kind: str, t: dict[str, torch.Tensor]):
    if kind == "delta":
        def piece(y, side, carries):
            b, n = y.shape[:2]
            q, k, v = torch.split(y, [HK * DK, HK * DK, HV * DV], dim=-1)
            beta, g = side
            return delta_piece(naive_gated_delta, q.reshape(b, n, HK, DK), k.reshape(b, n, HK, DK),
                               v.reshape(b, n, HV, DV), g, beta, carries)
        return piece
    if kind == "rglru":
        def piece(y, side, carries):
            def scan(v, la):  # from a zero state, no reset inside
                return naive_rg_lru_scan(None, v, la.exp(), torch.zeros_like(v, dtype=torch.bool))
            return diagonal_piece(scan, y, side[0], carries)
        return piece
    if kind == "selective":
        sel = SelectiveParams(a=-t["a_log"].exp(), d=t["d"], dt_bias=t["dt_bias"])

        def piece(y, side, carries):
            return selective_piece(naive_selective_scan, y, *side, sel, carries)
        return piece
    prm = SSDParams(a=-t["a_log"].exp(), d=t["d"], dt_bias=t["dt_bias"], dt_limit=(0.0, float("inf")), chunk_size=8)

    def piece(y, side, carries):
        b, n = y.shape[:2]
        x, bb, cc = torch.split(y, [H * P, G * N, G * N], dim=-1)
        return ssd_piece(naive_ssd, x.reshape(b, n, H, P), side[0], bb.reshape(b, n, G, N), cc.reshape(b, n, G, N),
                         prm, carries)
    return piece


def _side(kind: str, t: dict[str, torch.Tensor], cut) -> tuple[torch.Tensor, ...]:
    if kind == "delta":
        return cut(t["beta"]).sigmoid(), -F.softplus(cut(t["a"])) * 0.7
    if kind == "selective":
        return cut(t["dt"]), cut(t["bm"]), cut(t["cm"]), cut(t["z"])
    if kind == "rglru":
        return (-F.softplus(cut(t["a"])),)
    return (cut(t["dt"]),)


def _reference(kind: str, t: dict[str, torch.Tensor], bounds) -> torch.Tensor:
    """Each row, each document on its own: conv from zeros, recurrence from a zero state."""
    conv, piece = _conv(t["w"], t["bias"]), _piece_fn(kind, t)
    rows = []
    for i, bnd in enumerate(bounds):
        edges = [0, *bnd, t["x"].shape[1]]
        docs = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            def cut(z, i=i, lo=lo, hi=hi):
                return z[i : i + 1, lo:hi]
            y = conv(cut(t["x"]))
            docs.append(y if kind == "conv" else piece(y, _side(kind, t, cut), False).out)
        rows.append(torch.cat(docs, dim=1))
    return torch.cat(rows, dim=0)


def _grads(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.grad.detach().clone() if v.grad is not None else None) for k, v in t.items()}


def run_case(mesh, kind: str, b: int, s: int, bounds, mode: str, seed: int) -> dict:
    t_ref, t_sp = _inputs(kind, b, s, seed), _inputs(kind, b, s, seed)
    want = _reference(kind, t_ref, bounds)
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    (want * weight).sum().backward()
    plan = ring_plan(s, mesh.ring_degree, mesh.ring_rank, mesh.effective_layout, bounds)

    def cut(z):
        return seqpar.shard(z, mesh, 1)

    if kind == "conv":  # the halo alone (short convolutions)
        got = ring_conv(cut(t_sp["x"]), plan, mesh, _conv(t_sp["w"], t_sp["bias"]), K)
    else:
        got = ring_recurrence(cut(t_sp["x"]), _side(kind, t_sp, cut), plan, mesh, _conv(t_sp["w"], t_sp["bias"]),
                              _piece_fn(kind, t_sp), TRANSITION[kind], K, mode)
    (got * cut(weight)).sum().backward()
    full = seqpar.unshard(got.detach(), mesh, 1)
    gr, gs = _grads(t_ref), _grads(t_sp)
    err = {"out": float((full - want.detach()).abs().max())}
    for name in gr:
        g_sp = gs[name]
        if g_sp is None:  # an input the conv alone does not read
            continue
        if g_sp.dim() == 3 and g_sp.shape[1] == s:  # per-token input: this rank's shard holds its gradient
            err[name] = float((cut(g_sp) - cut(gr[name])).abs().max())
        else:  # parameters: every rank contributes
            torch.distributed.all_reduce(g_sp, group=mesh.ring_group)
            err[name] = float((g_sp - gr[name]).abs().max())
    return err


def world_cases(cases: list[tuple]) -> list[tuple]:
    meshes, out = {}, []
    for layout, kind, b, s, bounds, mode in cases:
        if layout not in meshes:
            w = torch.distributed.get_world_size()
            meshes[layout] = seqpar.init_mesh(w, ulysses_degree=1, ring_degree=w, layout=layout)
        err = run_case(meshes[layout], kind, b, s, bounds, mode, seed=len(out))
        out.append(((layout, kind, b, s, bounds, mode), err))
    return out


def _check(per_rank: list) -> None:
    bad = [(rank, key, err) for rank, res in enumerate(per_rank) for key, err in res if max(err.values()) > TOL]
    assert not bad, "\n".join(map(str, bad))
    worst = max(max(err.values()) for res in per_rank for _, err in res)
    print(f"{sum(len(r) for r in per_rank)} case-ranks, worst error {worst:.2e}")


# zigzag ring 2 at S=24: chunks of 6 at 0 / 6 / 12 / 18 (rank 0: 0-5 and 18-23; rank 1: 6-17)
CASES_R2 = [
    ("zigzag", "delta", 2, 24, ((), ()), "chain"),
    ("zigzag", "delta", 1, 24, ((4, 13),), "chain"),  # a document across the 6 / 12 seams, one ending 2 before
    ("zigzag", "delta", 1, 24, ((6, 19),), "scan"),  # documents on a seam and 1 after one
    ("zigzag", "ssd", 2, 24, ((), ()), "chain"),
    ("zigzag", "ssd", 2, 24, ((7,), (2, 14, 20)), "scan"),  # packed rows, different documents per row
    ("contiguous", "delta", 2, 24, ((), (12,)), "scan"),
    ("contiguous", "ssd", 1, 24, ((10,),), "chain"),
]


def test_ring2_fast():
    """Ring 2, both kinds, both modes, zigzag and contiguous, unpacked and packed."""
    _check(run_distributed(world_cases, 2, CASES_R2, timeout=300))


def test_diagonal_piece_reset_inside():
    """A reset (a_t = 0, log a_t = -inf) inside a piece that carries a state in: the correction stops there, and the
    gradients stay finite (float64, against the loop from that state)."""
    g = torch.Generator().manual_seed(3)
    x, la = (torch.randn(2, 9, D1, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    s0 = torch.randn(2, D1, generator=g, dtype=torch.float64).requires_grad_()
    reset = torch.zeros(2, 9, 1, dtype=torch.bool)
    reset[0, 4] = True
    a = -F.softplus(la)

    def scan(v, lg):
        return naive_rg_lru_scan(None, v, lg.exp(), reset)

    res = diagonal_piece(scan, x, a.masked_fill(reset, float("-inf")), True)
    got = res.out + res.correct(s0)
    want, _ = naive_rg_lru_scan(None, x, a.exp(), reset, s0)
    assert float((got - want).detach().abs().max()) < 1e-14
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    grads = [torch.autograd.grad((y * w).sum(), (x, la, s0), retain_graph=True) for y in (got, want)]
    assert all(float((p - q).abs().max()) < 1e-13 for p, q in zip(*grads)), grads


CASES_NEW = [  # Mamba1's selective scan and the RG-LRU ("diagonal" transitions) and the conv alone, in threads
    ("zigzag", "selective", 2, 24, ((), ()), "chain"),
    ("zigzag", "selective", 2, 24, ((4, 13), (6, 19)), "scan"),
    ("contiguous", "selective", 1, 24, ((10,),), "chain"),
    ("zigzag", "rglru", 2, 24, ((), ()), "chain"),
    ("zigzag", "rglru", 2, 24, ((5, 12), (6, 19)), "scan"),
    ("contiguous", "rglru", 1, 24, ((10,),), "chain"),
    ("zigzag", "conv", 2, 24, ((4, 13), ()), "chain"),
    ("contiguous", "conv", 1, 24, ((12,),), "chain"),
]


@pytest.mark.parametrize("world", [2, 3])
def test_selective_and_conv_threaded(world):
    """Ring 2 and 3 (zigzag 3 at S=24: 4-token chunks; the halo of 3 fits), packed rows with documents on and off
    the seams, both state-passing modes."""
    _check(run_threaded(world_cases, world, CASES_NEW, timeout=300))


CASES_R3 = [
    ("zigzag", "delta", 1, 12, ((),), "chain"),  # 2-token chunks: a halo of 3 spans two chunks
    ("zigzag", "ssd", 1, 12, ((5,),), "scan"),
    ("zigzag", "delta", 2, 30, ((), (11, 16)), "chain"),
    ("contiguous", "ssd", 2, 30, ((9,), ()), "chain"),
]
CASES_R4 = [
    ("zigzag", "delta", 1, 32, ((3, 9, 21),), "chain"),
    ("zigzag", "delta", 2, 32, ((), ()), "scan"),
    ("zigzag", "ssd", 1, 32, ((4, 17),), "chain"),
    ("contiguous", "ssd", 2, 32, ((), (8, 25)), "scan"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [(3, CASES_R3), (4, CASES_R4)], ids=["ring3", "ring4"])
def test_ring_odd_and_4(world, cases):
    _check(run_distributed(world_cases, world, cases, timeout=600))
