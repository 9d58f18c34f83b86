"""`python -m seqpar.bench gpu --parts sp`: one Ulysses-4 and one ring-4 attention step on ONE GPU, its ranks threads
of one process (seqpar.threaded), and where the GPU's time goes: the attention kernels vs the merges, copies and
layout work that sequence parallelism adds (the SP cost that is not communication), vs the same step in a world of 1.

Inputs: bf16, B = 1, 32 q / 8 kv heads of 128 (Llama-8B's attention), causal, S tokens in all, `kernel` 'auto'.
Every rank's kernels run on the device's one stream, so a step's GPU time is the sum over the ranks. The step is
profiled once after a warm-up (torch.profiler, CUDA activity); each op's own device time (self time, so nested ops
count once) goes to one category:
- attention: the fused attention ops (flash, cuDNN, memory-efficient);
- communication: ops run by the threaded process group's collectives / point-to-point (on GPUs with NCCL these are
  transfers, not kernels: shown, not counted as SP overhead);
- copies / layout: copy_, cat, index / gather / scatter, fill / zero (head plans, zigzag gathers, exchange buffers,
  accumulators, dtype casts);
- merge / other: the rest (the ring's log-sum-exp merges, adds of partial gradients).
Wall time per step: CUDA-synchronised, between barriers, on rank 0 (all ranks' work included).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..threaded import COMM_RANGE

__all__ = ["sp_rows", "sp_lines", "categorise"]

HQ, HKV, D = 32, 8, 128
_ATTENTION = ("attention",)
_COPY = ("copy", "cat", "index", "gather", "scatter", "fill", "zero", "clone", "contiguous", "stack", "repeat")


def categorise(name: str, ranges: list[str]) -> str:
    """The category of one profiled op, by its name and the profiler ranges it ran in."""
    if COMM_RANGE in ranges:
        return "communication"
    low = name.lower()
    if any(m in low for m in _ATTENTION):
        return "attention"
    if any(m in low for m in _COPY):
        return "copies_layout"
    return "merge_other"


def _inputs(s: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, s, h, D, device=device, generator=g, dtype=dtype) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn_like(q)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rank_step(u: int, r: int, q, k, v, do, reps: int) -> float:
    """One rank: warm-up, then `reps` timed fwd+bwd steps of its shards; the median step seconds (all ranks')."""
    import torch.distributed as dist

    import seqpar

    mesh = seqpar.init_mesh(u * r, ulysses_degree=u, ring_degree=r) if u * r > 1 else seqpar.init_mesh(1)
    ql, kl, vl = (seqpar.shard(t, mesh, 1).detach().clone().requires_grad_() for t in (q, k, v))
    dl = seqpar.shard(do, mesh, 1)
    times = []
    for i in range(reps + 1 if reps else 1):
        if u * r > 1:
            dist.barrier()
        _sync()
        t0 = time.perf_counter()
        seqpar.attention(ql, kl, vl, mesh).backward(dl)
        if u * r > 1:
            dist.barrier()
        _sync()
        if i or not reps:  # the first step warms up, unless it is the only one
            times.append(time.perf_counter() - t0)
        ql.grad = kl.grad = vl.grad = None
    return sorted(times)[len(times) // 2]


def _profile(fn, cuda: bool) -> dict[str, float]:
    """Each op's own time by category: device time on CUDA, CPU time on the CPU (a smoke run of the same code)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the ranks are threads
    with profile(activities=acts, experimental_config=every_thread) as prof:
        fn()
        _sync()
    ms: dict[str, float] = {"attention": 0.0, "communication": 0.0, "copies_layout": 0.0, "merge_other": 0.0}
    for e in prof.events():
        if not e.name.startswith("aten::"):  # autograd / Python ranges: their own time is not a kernel's
            continue
        own = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        if own > 0:
            ms[categorise(e.name, _ranges(e))] += own / 1e3
    return ms


def _ranges(e) -> list[str]:
    out, p = [], e.cpu_parent
    while p is not None:
        out.append(p.name)
        p = p.cpu_parent
    return out


def sp_rows(s: int = 32768, modes=((1, 1), (4, 1), (1, 4)), reps: int = 3,
            device: str = "cuda") -> list[dict[str, Any]]:
    """One row per mode (world 1 first: the reference for the SP overhead). device="cpu": fp32 on the CPU kernel, the
    same code as a smoke run (op CPU times instead of device times)."""
    from ..threaded import run_threaded

    cuda = device == "cuda"
    q, k, v, do = _inputs(s, device, torch.bfloat16 if cuda else torch.float32)
    rows = []
    for u, r in modes:
        world = u * r

        def step(n: int, u=u, r=r, world=world) -> float:
            return run_threaded(_rank_step, world, u, r, q, k, v, do, n, device=device, timeout=300)[0]

        row: dict[str, Any] = {"S": s, "ulysses": u, "ring": r, "hq": HQ, "hkv": HKV, "d": D, "device": device,
                               "dtype": str(q.dtype).replace("torch.", "")}
        try:
            row["step_ms"] = 1e3 * step(reps)
            ms = _profile(lambda: step(0), cuda)  # one more step, already warm
            busy = sum(v_ for k_, v_ in ms.items() if k_ != "communication")
            row["gpu_ms"] = ms
            row["share_of_compute"] = {k_: v_ / busy for k_, v_ in ms.items() if k_ != "communication" and busy}
        except Exception as e:  # noqa: BLE001 - reported in the JSON, the other rows still run
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    base = next((x for x in rows if x["ulysses"] * x["ring"] == 1 and "gpu_ms" in x), None)
    for x in rows:
        if base is not None and "gpu_ms" in x and x is not base:
            x["sp_overhead_ms_vs_world1"] = {k_: x["gpu_ms"][k_] - base["gpu_ms"][k_]
                                             for k_ in ("attention", "copies_layout", "merge_other")}
    return rows


def sp_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for x in rows:
        name = f"world {x['ulysses'] * x['ring']} (ulysses {x['ulysses']} x ring {x['ring']})"
        if "error" in x:
            out.append(f"  sp {name}: FAILED {x['error'][:200]}")
            continue
        ms = x["gpu_ms"]
        share = {k: x["share_of_compute"].get(k, 0.0) for k in ("attention", "copies_layout", "merge_other")}
        out.append(f"  sp {name}, S={x['S']}: step {x['step_ms']:.1f} ms; kernels: attention {ms['attention']:.1f} ms "
                   f"({100 * share['attention']:.0f}%), copies/layout {ms['copies_layout']:.1f} ms "
                   f"({100 * share['copies_layout']:.0f}%), merge/other {ms['merge_other']:.1f} ms "
                   f"({100 * share['merge_other']:.0f}%), threaded-PG transfers {ms['communication']:.1f} ms")
    return out
