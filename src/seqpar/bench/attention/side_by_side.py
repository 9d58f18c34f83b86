"""Part 4 of the attention benchmark (`--peers`): seqpar against yunchang (Ulysses, zigzag ring, USP) and torch's
context parallel (load-balanced ring, all-gather and all-to-all rotation) on the same shards, every local attention
on the same CPU flash kernel (peer_adapters.py says what each adapter changes).

Per case (full length S, P ranks, Hq / Hkv heads, D, fp32, causal, B = 1) and implementation, on every rank:
- exactness: out and dq, dk, dv against float64 (the CPU flash kernel on float64 copies of the full sequence in one
  process, rank 0, broadcast), max abs error over ranks;
- memory: the per-rank peak of live tensors during one fwd+bwd (torch's MemTracker through seqpar's
  PeakMemoryMeter: every tensor of the step, the inputs q, k, v, the incoming gradient and the gradients of q, k, v
  included: they are made inside the measurement), max over ranks; and the same inside a checkpointed call
  (torch.utils.checkpoint, non-reentrant: the forward recomputed in backward);
- time: main-thread CPU seconds of the slowest rank per fwd+bwd (wall time is too noisy on shared cores), median
  of `reps`, the implementations taking turns; wall seconds alongside.
A peer that refuses a case (raises) is recorded with its error, on every rank, before the next implementation.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import peer_adapters as pa
from .inputs import qkv

__all__ = ["PeerCase", "peer_cases", "parse_cases", "PEERS", "run_side_by_side", "rank_side_by_side",
           "side_by_side_section", "side_by_side_lines"]

MIB = 2**20
PEERS = ("yunchang", "torch_cp")


@dataclass(frozen=True)
class PeerCase:
    seq: int
    sp: int
    heads: int
    kv_heads: int
    head_dim: int = 64

    @property
    def label(self) -> str:
        return f"S={self.seq} P={self.sp} {self.heads}/{self.kv_heads} heads D={self.head_dim}"


def peer_cases(quick: bool) -> list[PeerCase]:
    """The done-criterion case first (S = 16384, P = 2, 8 / 8 heads), then the shapes where peers differ."""
    if quick:
        return [PeerCase(256, 2, 4, 4, 16), PeerCase(256, 4, 8, 2, 16), PeerCase(256, 4, 6, 6, 16)]
    return [PeerCase(16384, 2, 8, 8), PeerCase(4096, 2, 8, 8), PeerCase(4096, 2, 8, 2), PeerCase(4096, 4, 8, 8),
            PeerCase(4096, 4, 8, 2), PeerCase(4096, 4, 6, 6)]


def parse_cases(text: str) -> list[PeerCase]:
    """'S:P:HQ:HKV[:D],...' (e.g. '16384:2:8:8,4096:4:8:2') -> cases."""
    out = []
    for item in text.split(","):
        parts = [int(x) for x in item.split(":")]
        if len(parts) not in (4, 5) or parts[1] not in (2, 4):
            raise ValueError(f"--peer-cases {item!r}: use S:P:HQ:HKV[:D] with P 2 or 4")
        out.append(PeerCase(*parts))
    return out


def _meshes(sp: int) -> dict[str, Any]:
    import seqpar

    out = {"ulysses": seqpar.init_mesh(sp, ulysses_degree=sp, ring_degree=1),
           "ring": seqpar.init_mesh(sp, ulysses_degree=1, ring_degree=sp, layout="zigzag")}
    if sp == 4:
        out["usp"] = seqpar.init_mesh(sp, ulysses_degree=2, ring_degree=2, layout="zigzag")
    return out


def _impls(meshes: dict[str, Any], scale: float, peers: tuple[str, ...]) -> dict[str, tuple[Any, Any, Any]]:
    """name -> (the mesh whose shards it takes, call (q, k, v) -> out, context around its fwd and bwd)."""
    import seqpar

    none = contextlib.nullcontext
    out: dict[str, tuple[Any, Any, Any]] = {}
    for mode, mesh in meshes.items():
        out[f"seqpar_{mode}"] = (mesh, lambda q, k, v, m=mesh: seqpar.attention(q, k, v, m, causal=True,
                                                                                 kernel="cpu"), none)
    if "yunchang" in peers:
        uly, ring = meshes["ulysses"], meshes["ring"]
        out["yunchang_ulysses"] = (uly, pa.yunchang_ulysses(uly.ulysses_group, scale), none)
        out["yunchang_ring"] = (ring, pa.yunchang_ring(ring.ring_group, scale), pa.yunchang_on_cpu)
        if "usp" in meshes:
            usp = meshes["usp"]
            out["yunchang_usp"] = (usp, pa.yunchang_usp(usp.ulysses_group, usp.ring_group, scale), pa.yunchang_on_cpu)
    if "torch_cp" in peers:
        ring = meshes["ring"]
        for method in ("allgather", "alltoall"):
            out[f"torch_cp_{method}"] = (ring, pa.torch_cp_ring(ring.ring_group, scale, method), none)
    return out


def _reference(case: PeerCase, full, dout) -> list[torch.Tensor]:
    """out, dq, dk, dv of the whole sequence in float64 on rank 0 (the CPU flash kernel), broadcast to all."""
    from ...attention.kernels import CpuFlashKernel, default_scale

    shapes = [full[0].shape, *(t.shape for t in full)]
    res = [torch.empty(s, dtype=torch.float64) for s in shapes]
    if dist.get_rank() == 0:
        kern, scale = CpuFlashKernel(), default_scale(case.head_dim)
        q, k, v = (t.double() for t in full)
        o, lse = kern.forward(q, k, v, True, scale)
        res = [o, *kern.backward(dout.double(), q, k, v, o, lse, True, scale)]
    for t in res:
        dist.broadcast(t, 0)
    return res


def _step(call, context, q, k, v, dout, checkpoint: bool = False):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    c0, t0 = time.thread_time(), time.perf_counter()
    with context():
        if checkpoint:
            out = torch.utils.checkpoint.checkpoint(call, q, k, v, use_reentrant=False)
        else:
            out = call(q, k, v)
        out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad), time.thread_time() - c0, time.perf_counter() - t0


def _peak(call, context, q, k, v, dout, checkpoint: bool) -> int:
    from ...memory.meter import PeakMemoryMeter

    meter = PeakMemoryMeter(torch.nn.Module(), device="cpu")
    with meter.measure():  # the inputs and the incoming gradient are made inside: they count, for everyone alike
        _step(call, context, *(t.clone() for t in (q, k, v, dout)), checkpoint=checkpoint)
    return int(meter.last["peak_bytes"])


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _guarded(fn) -> tuple[Any, str | None]:
    """fn() on every rank; a refusal on any rank is every rank's (so no rank goes on into a collective alone)."""
    try:
        res, err = fn(), None
    except Exception as e:  # a peer's refusal: recorded, not raised
        res, err = None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
        traceback.print_exc()
    failed = torch.tensor([err is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() and err is None:
        err = "another rank failed"
    return res, err


def _run_case(case: PeerCase, reps: int, peers: tuple[str, ...]) -> dict[str, Any]:
    import seqpar

    full = qkv(case.seq, case.heads, case.kv_heads, case.head_dim, torch.float32, seed=11)
    dout = torch.randn(1, case.seq, case.heads, case.head_dim, generator=torch.Generator().manual_seed(12))
    ref = _reference(case, full, dout)
    from ...attention.kernels import default_scale

    impls = _impls(_meshes(case.sp), default_scale(case.head_dim), peers)
    rows: dict[str, dict[str, Any]] = {}
    local = {}
    for name, (mesh, call, ctx) in impls.items():
        shards = [seqpar.shard(t, mesh) for t in (*full, dout)]
        want = [seqpar.shard(t, mesh) for t in ref]
        local[name] = shards

        def exact(call=call, ctx=ctx, shards=shards, want=want):
            out, grads, _, _ = _step(call, ctx, *shards)
            return max(float((a.double() - b).abs().max()) for a, b in zip((out, *grads), want))

        err, refused = _guarded(exact)
        rows[name] = {"refused": refused}
        if refused:
            continue
        rows[name]["max_abs_err"] = _max(err)
        for key, ck in (("peak_bytes", False), ("checkpointed_peak_bytes", True)):
            peak, refused = _guarded(lambda call=call, ctx=ctx, shards=shards, ck=ck: _peak(call, ctx, *shards, ck))
            rows[name][key] = None if refused else int(_max(peak))
        rows[name].update(cpu_s=[], wall_s=[])
    names = [n for n in impls if not rows[n]["refused"]]
    for rep in range(reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:  # taking turns at going first
            dist.barrier()
            _, _, cpu, wall = _step(impls[name][1], impls[name][2], *local[name])
            rows[name]["cpu_s"].append(_max(cpu))
            rows[name]["wall_s"].append(_max(wall))
    for name in names:
        r = rows[name]
        r["median_cpu_s"] = statistics.median(r["cpu_s"]) if r["cpu_s"] else None
        r["median_wall_s"] = statistics.median(r["wall_s"]) if r["wall_s"] else None
    return {"case": asdict(case), "label": case.label, "results": rows}


def rank_side_by_side(cases: list[PeerCase], reps: int, peers: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every case of this world's size, in order (rank 0's copy of the results is the one reported)."""
    return [_run_case(c, reps, peers) for c in cases if c.sp == dist.get_world_size()]


def run_side_by_side(peers: tuple[str, ...] = PEERS, quick: bool = False, cases: list[PeerCase] | None = None,
                     reps: int | None = None, timeout: float = 1800.0) -> dict[str, Any]:
    """The JSON document of `python -m seqpar.bench attention --peers`: one spawned world per P."""
    import os

    import seqpar
    from seqpar.spawn import run_distributed

    from .driver import machine_info

    missing = [p for p in peers if p == "yunchang" and not pa.yunchang_available()]
    present = tuple(p for p in peers if p not in missing)
    cases = cases or peer_cases(quick)
    reps = reps or (2 if quick else 5)
    t0, load = time.time(), os.getloadavg()
    results: list[dict[str, Any]] = []
    for sp in sorted({c.sp for c in cases}):
        results += run_distributed(rank_side_by_side, sp, cases, reps, present, timeout=timeout)[0]
    order = {c.label: i for i, c in enumerate(cases)}
    results.sort(key=lambda r: order[r["label"]])
    versions = {k: v if (k != "yunchang" or "yunchang" in present) else None for k, v in pa.peer_versions().items()}
    if "torch_cp" not in present:
        versions["torch_context_parallel"] = None
    return {"benchmark": "attention_peers", "schema_version": 1, "quick": quick, "seqpar_version": seqpar.__version__,
            "created_unix": t0, "machine": machine_info(load), "missing_peers": missing,
            "side_by_side": side_by_side_section(results, reps, versions), "elapsed_s": time.time() - t0}


_PAIRS = (("seqpar_ulysses", "yunchang_ulysses"), ("seqpar_ring", "yunchang_ring"), ("seqpar_usp", "yunchang_usp"),
          ("seqpar_ring", "torch_cp_allgather"), ("seqpar_ring", "torch_cp_alltoall"))


def _ratios(res: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """seqpar / peer for peak, checkpointed peak and median CPU s, where both ran."""
    out = {}
    for ours, theirs in _PAIRS:
        a, b = res.get(ours), res.get(theirs)
        if not a or not b or a["refused"] or b["refused"]:
            continue
        out[f"{ours}/{theirs}"] = {k: (a[k] / b[k] if a.get(k) and b.get(k) else None)
                                   for k in ("peak_bytes", "checkpointed_peak_bytes", "median_cpu_s")}
    return out


def side_by_side_section(results: list[dict[str, Any]], reps: int, versions: dict[str, Any]) -> dict[str, Any]:
    for r in results:
        r["ratios"] = _ratios(r["results"])
    return {
        "description": (
            "seqpar vs peers on the same shards and the same CPU flash kernel: max abs error vs float64 (out and "
            "dq, dk, dv, max over ranks), per-rank peak of live tensors during one fwd+bwd (MemTracker, max over "
            "ranks; inputs, incoming gradient and input gradients counted; 'checkpointed': inside "
            "torch.utils.checkpoint), "
            "main-thread CPU s of the slowest rank (median of reps) and wall s. fp32, causal, B=1, 1 thread per "
            "rank. refused: the error the implementation raised on this case."
        ),
        "dtype": "float32", "causal": True, "batch": 1, "reps": reps, "versions": versions, "cases": results,
    }


def _mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def side_by_side_lines(res: dict[str, Any]) -> list[str]:
    """The markdown summary of `run_side_by_side`'s document."""
    sec, v = res["side_by_side"], res["side_by_side"]["versions"]
    out = [f"{p} is not installed (pip install 'seqpar[peers]'): its rows are missing" for p in res["missing_peers"]]
    out += ["", f"### seqpar vs peers (same shards, same CPU flash kernel; yunchang {v.get('yunchang') or 'missing'}, "
           f"torch context parallel {v.get('torch_context_parallel') or 'missing'}), fp32, causal, median of "
           f"{sec['reps']}", ""]
    for c in sec["cases"]:
        out += [f"{c['label']}:", "",
                "| implementation | max abs err | peak MiB | checkpointed peak MiB | CPU s | wall s |",
                "|---|---:|---:|---:|---:|---:|"]
        for name, r in c["results"].items():
            if r["refused"]:
                out.append(f"| {name} | refused: {r['refused'][:90]} | | | | |")
                continue
            out.append(f"| {name} | {r['max_abs_err']:.1e} | {_mib(r['peak_bytes'])} | "
                       f"{_mib(r['checkpointed_peak_bytes'])} | {r['median_cpu_s'] or 0:.3f} | "
                       f"{r['median_wall_s'] or 0:.3f} |")
        for pair, rr in c["ratios"].items():
            f = {k: ("-" if x is None else f"{x:.3f}x") for k, x in rr.items()}
            out.append(f"\n{pair}: peak {f['peak_bytes']}, checkpointed {f['checkpointed_peak_bytes']}, CPU s "
                       f"{f['median_cpu_s']}")
        out.append("")
    mc = res["machine"]
    return out + [f"Machine: {mc['cpu_count']} CPUs, torch {mc['torch']}; load average (1 min) start "
                  f"{mc['loadavg_start'][0]:.2f}, end {mc['loadavg_end'][0]:.2f}. Total {res['elapsed_s']:.0f} s."]
