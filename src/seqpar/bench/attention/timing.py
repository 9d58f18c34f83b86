"""Part 3 of the attention benchmark: fwd+bwd wall and CPU time of SP (P=2, 1 thread per rank; seqpar Ulysses,
ring, and DeepSpeed Ulysses when installed) vs torch SDPA and seqpar in one process (1 thread), interleaved in the
same run so all see the same machine load; medians over repeats; a profile of where the time goes; the kernel's
own rate and the CPU ratio a glue-free rival on the same kernel would reach (kernel_bound.py). Rank code, the
JSON section and its markdown tables.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..kernel_bound import cpu_ratio_floor, kernel_rate
from .inputs import qkv

__all__ = ["rank_timing", "median_summary", "timing_section", "timing_lines"]


def _step(call, q, k, v, dout, heads_first: bool = False) -> dict[str, float]:
    """One fwd+bwd of `call`: wall time per pass, and this rank's CPU time (main thread; whole process)."""
    if heads_first:  # torch SDPA wants [B, H, S, D]
        q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    out = call(q, k, v)
    t1 = time.perf_counter()
    out.backward(dout)
    t2 = time.perf_counter()
    return {"fwd": t1 - t0, "bwd": t2 - t1, "cpu": time.thread_time() - c0, "proc": time.process_time() - p0}


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _timed_calls(world: int, heads: int, use_ds: bool) -> tuple[dict, dict, dict]:
    """The SP modes (their meshes and calls) and the one-process baselines (call, wants [B, H, S, D])."""
    import seqpar

    meshes = {
        "ulysses": seqpar.init_mesh(world, ulysses_degree=world, ring_degree=1),
        "ring": seqpar.init_mesh(world, ulysses_degree=1, ring_degree=world, layout="zigzag"),
    }
    one = seqpar.init_mesh(1)  # dp=world, sp=1: every collective of seqpar.attention is a no-op
    calls = {m: (lambda q, k, v, mesh=mesh: seqpar.attention(q, k, v, mesh, causal=True)) for m, mesh in meshes.items()}
    # Ulysses with 2 head chunks: chunk 2's all-to-all in flight during chunk 1's kernel (and back).
    meshes["ulysses_overlap2"] = meshes["ulysses"]
    uly = meshes["ulysses"]
    calls["ulysses_overlap2"] = lambda q, k, v: seqpar.attention(q, k, v, uly, causal=True, overlap_chunks=2)
    alone = {
        "single_process": (_sdpa, True),
        "seqpar_one_process": (lambda q, k, v: seqpar.attention(q, k, v, one, causal=True), False),
    }
    if use_ds:
        from ..peers import DeepSpeedUlysses, setup_deepspeed

        setup_deepspeed()
        meshes["deepspeed_ulysses"] = meshes["ulysses"]  # same contiguous shards, same group
        calls["deepspeed_ulysses"] = DeepSpeedUlysses(meshes["ulysses"].ulysses_group, heads)
    return meshes, calls, alone


def rank_timing(seq: int, heads: int, d: int, reps: int, use_ds: bool) -> dict[str, Any]:
    """Per repeat: each SP mode at P=2, then on rank 0 alone (rank 1 waits in a barrier) torch SDPA
    and seqpar's own one-process path (sp_size=1: the local kernel, fp32 merge buffer and all).

    SP step wall time = slowest rank. CPU times are summed and maxed over ranks: they do not depend
    on how many other processes share the cores, so they show the work split even on a loaded machine.
    """
    import seqpar

    world = dist.get_world_size()
    meshes, calls, alone = _timed_calls(world, heads, use_ds)
    full = qkv(seq, heads, heads, d, torch.float32, seed=2)
    dout_full = torch.randn(1, seq, heads, d, generator=torch.Generator().manual_seed(3))
    local = {m: ([seqpar.shard(t, mesh) for t in full], seqpar.shard(dout_full, mesh)) for m, mesh in meshes.items()}
    keys = ("fwd_s", "bwd_s", "cpu_s_max_rank", "cpu_s_sum_ranks", "process_cpu_s_sum_ranks")
    res: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in (*meshes, *alone)}
    loads = []
    names = list(meshes)
    for rep in range(reps + 1):  # rep 0 warms up and is dropped
        # the SP modes take turns going first (right after the baselines' long single-process passes), so no
        # mode always meets the same cache / frequency state
        for m in names[rep % len(names):] + names[: rep % len(names)]:
            (q, k, v), dout = local[m]
            dist.barrier()
            r = _step(calls[m], q, k, v, dout)
            mx = torch.tensor([r["fwd"], r["bwd"], r["cpu"]], dtype=torch.float64)
            sm = torch.tensor([r["cpu"], r["proc"]], dtype=torch.float64)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            dist.all_reduce(sm)
            if rep:
                for key, val in zip(keys, [*mx.tolist(), *sm.tolist()]):
                    res[m][key].append(val)
        dist.barrier()
        if dist.get_rank() == 0:
            for name, (call, heads_first) in alone.items():
                r = _step(call, *full, dout_full, heads_first=heads_first)
                if rep:
                    for key, val in zip(keys, (r["fwd"], r["bwd"], r["cpu"], r["cpu"], r["proc"])):
                        res[name][key].append(val)
            loads.append(os.getloadavg()[0])
        dist.barrier()
    profiled = [m for m in ("ulysses", "ulysses_overlap2", "deepspeed_ulysses") if m in calls]
    profiles = {m: _profile(calls[m], *local[m][0], local[m][1]) for m in profiled}
    # The kernel alone at one Ulysses rank's shape, on rank 0 while rank 1 waits (one busy core).
    rate = kernel_rate(seq, max(1, heads // world), d) if dist.get_rank() == 0 else None
    dist.barrier()
    return {"runs": res, "loadavg_1min": loads, "profile": profiles, "kernel_rate": rate}


_PROFILE_CATEGORIES = (
    ("kernel", ("flash_attention",)),
    ("all_to_all", ("alltoall", "all_to_all", "c10d::")),
    ("copies", ("copy_", "aten::cat", "aten::stack", "aten::clone", "contiguous", "_to_copy", "index_select")),
    ("alloc_fill", ("aten::empty", "aten::zeros", "aten::fill_", "aten::zero_", "new_zeros", "new_empty")),
)


def _profile_category(key: str) -> str:
    for name, needles in _PROFILE_CATEGORIES:
        if any(n in key for n in needles):
            return name
    return "other_ops" if key.startswith("aten::") else "python_and_wait"


def _profile(call, q, k, v, dout) -> dict[str, float]:
    """One fwd+bwd under torch.profiler on every rank: self time (s) per category, slowest rank's total.
    python_and_wait: self time of non-aten frames (autograd Functions, Python glue, waiting on a peer)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(q, k, v).backward(dout)
    cats: dict[str, float] = {}
    for e in prof.key_averages():
        c = _profile_category(e.key)
        cats[c] = cats.get(c, 0.0) + e.self_cpu_time_total / 1e6
    names = sorted(cats)
    t = torch.tensor([cats[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # same category set on every rank (same code path)
    return dict(zip(names, t.tolist()))


def median_summary(runs: dict[str, list[float]]) -> dict[str, Any]:
    tot = [f + b for f, b in zip(runs["fwd_s"], runs["bwd_s"])]
    med = {f"median_{k}": statistics.median(v) for k, v in runs.items()}
    # External load only ever adds time, so the best repeat is the closest to an idle machine.
    return {**runs, **med, "median_total_s": statistics.median(tot), "min_total_s": min(tot)}


def timing_section(timing: dict[str, Any], seq: int, heads: int, d: int, reps: int) -> dict[str, Any]:
    """The JSON document's "timing" part, from rank 0's `rank_timing` result."""
    summaries = {m: median_summary(r) for m, r in timing["runs"].items()}
    base_key = "single_process"
    base = summaries[base_key]
    others = {m: v for m, v in summaries.items() if m != base_key}
    return {
        "description": (
            "fwd+bwd wall time (SP step = slowest rank) and main-thread CPU time (max and sum over "
            "ranks); single_process = torch SDPA in one process, 1 thread. cpu_speedup = single "
            "CPU s / slowest rank's CPU s: what the split would give with a free core per rank"
        ),
        "sp_size": 2,
        "seq_len": seq,
        "batch": 1,
        "heads": heads,
        "head_dim": d,
        "dtype": "float32",
        "causal": True,
        "reps": reps,
        "threads_per_rank": 1,
        "loadavg_1min_during": timing["loadavg_1min"],
        "profile_s": timing["profile"],
        # the same kernel on both sides: its rate, and the CPU ratio a glue-free rival would reach
        "kernel_bound": {"kernel_rate": timing["kernel_rate"],
                         "cpu_ratio_floor": {m: cpu_ratio_floor(p) for m, p in timing["profile"].items()}},
        "results": summaries,
        "speedup_vs_single_process": {m: base["median_total_s"] / v["median_total_s"] for m, v in others.items()},
        "best_rep_speedup_vs_single_process": {m: base["min_total_s"] / v["min_total_s"] for m, v in others.items()},
        "cpu_speedup_vs_single_process": {
            m: base["median_cpu_s_max_rank"] / v["median_cpu_s_max_rank"] for m, v in others.items()
        },
    }


def timing_lines(t: dict[str, Any]) -> list[str]:
    """Markdown tables of the "timing" part: medians and speedups, seqpar vs DeepSpeed, the kernel bound, the
    profile."""
    out = [
        "",
        f"### Time, S={t['seq_len']}, B=1, H={t['heads']}, D={t['head_dim']}, fp32, causal, "
        f"P={t['sp_size']} (1 thread per rank) vs one process (1 thread): median of {t['reps']}, "
        "best = fastest repeat",
        "",
    ]
    out.append(
        "| run | fwd s | bwd s | fwd+bwd s | wall speedup | best fwd+bwd s | best-rep speedup "
        "| CPU s slowest rank | CPU s all ranks | CPU speedup |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    for name, v in t["results"].items():
        sp = t["speedup_vs_single_process"].get(name)
        bs = t["best_rep_speedup_vs_single_process"].get(name)
        cs = t["cpu_speedup_vs_single_process"].get(name)
        out.append(
            f"| {name} | {v['median_fwd_s']:.3f} | {v['median_bwd_s']:.3f} | {v['median_total_s']:.3f} | {x(sp)} "
            f"| {v['min_total_s']:.3f} | {x(bs)} | {v['median_cpu_s_max_rank']:.3f} | "
            f"{v['median_cpu_s_sum_ranks']:.3f} | {x(cs)} |"
        )
    out += _vs_deepspeed_lines(t)
    return out


def _vs_deepspeed_lines(t: dict[str, Any]) -> list[str]:
    """seqpar Ulysses / DeepSpeed Ulysses ratios (same run, same shards) and the profile table."""
    out: list[str] = []
    res = t["results"]
    if "deepspeed_ulysses" in res:
        ds = res["deepspeed_ulysses"]
        out += ["", "seqpar / DeepSpeed Ulysses, same run and shards (median fwd+bwd wall; median CPU s summed "
                "over ranks):", "", "| seqpar run | wall ratio | best-rep wall ratio | CPU ratio (sum of ranks) |",
                "|---|---:|---:|---:|"]
        for name in ("ulysses", "ulysses_overlap2"):
            v = res[name]
            out.append(f"| {name} | {v['median_total_s'] / ds['median_total_s']:.3f} | "
                       f"{v['min_total_s'] / ds['min_total_s']:.3f} | "
                       f"{v['median_cpu_s_sum_ranks'] / ds['median_cpu_s_sum_ranks']:.3f} |")
    out += _kernel_bound_lines(t.get("kernel_bound"))
    prof = t.get("profile_s") or {}
    if prof:
        cats = sorted({c for p in prof.values() for c in p})
        out += ["", "Where one fwd+bwd's time goes (torch.profiler self time, s, max over ranks; python_and_wait = "
                "autograd Functions, Python glue and waiting on the peer):", "",
                "| category | " + " | ".join(prof) + " |", "|---|" + "---:|" * len(prof)]
        out += [f"| {c} | " + " | ".join(f"{p.get(c, 0.0):.3f}" for p in prof.values()) + " |" for c in cats]
    return out


def _kernel_bound_lines(kb: dict[str, Any] | None) -> list[str]:
    """The kernel's rate against a matmul's, and each profiled run's kernel share (the glue-free floor)."""
    if not kb:
        return []
    r, out = kb["kernel_rate"], []
    if r:
        s = r["shape"]
        out += ["", f"The CPU flash kernel alone at one Ulysses rank's shape ({s['heads']} heads x {s['seq_len']} x "
                f"{s['head_dim']}, fp32, causal, {r['threads']} thread, best of {r['reps']}): fwd "
                f"{r['fwd_gflops']:.1f}, bwd {r['bwd_gflops']:.1f}, fwd+bwd {r['fwd_bwd_gflops']:.1f} useful GFLOP/s = "
                f"{r['fraction_of_matmul']:.2f} x this thread's fp32 matmul ({r['matmul_size']}^2: "
                f"{r['matmul_gflops']:.1f} GFLOP/s)."]
    floors = kb["cpu_ratio_floor"]
    if floors:
        out += ["", "Kernel share of each profiled fwd+bwd (self s): the CPU ratio against that run which the same "
                "kernel with no glue at all would give:", "", "| run | kernel s | glue s | kernel share (floor) |",
                "|---|---:|---:|---:|"]
        out += [f"| {m} | {f['kernel_s']:.3f} | {f['glue_s']:.3f} | {f['floor']:.3f} |" for m, f in floors.items()]
    return out
