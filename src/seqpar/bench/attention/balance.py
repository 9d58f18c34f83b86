"""Part 2 of the attention benchmark: causal load balance over the ring. Planned: forward FLOPs per ring rank from
the ring's own piece plan (contiguous and zigzag layouts). Measured at R=4: per-rank forward kernel CPU time (a
timing kernel wraps the CPU flash kernel, so only attention compute is counted), and the same predicted from
each piece shape's kernel time. Rank code, the JSON section and its markdown tables.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ...attention.costs import flops_per_rank, load_balance_table
from .inputs import qkv

__all__ = ["TimingKernel", "measure_balance", "shape_prediction", "balance_section", "balance_lines"]


class TimingKernel:
    """Wraps a local kernel; adds up this thread's CPU time and executed FLOPs in forward."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"timed-{inner.name}"
        self.cpu_s = 0.0
        self.flops = 0.0
        self.calls = 0

    def forward(self, q, k, v, causal, scale):
        t0 = time.thread_time()  # CPU time of this thread: robust to 4 ranks sharing 2 cores
        res = self.inner.forward(q, k, v, causal, scale)
        self.cpu_s += time.thread_time() - t0
        sq, sk = q.shape[1], k.shape[1]
        area = sq * (sq + 1) / 2 if causal else sq * sk
        self.flops += 4.0 * q.shape[0] * q.shape[2] * q.shape[3] * area
        self.calls += 1
        return res

    def backward(self, *args):
        return self.inner.backward(*args)


def measure_balance(layout: str, seq: int, heads: int, d: int, reps: int) -> dict[str, Any]:
    """Forward only at ring degree = world size; per-rank kernel CPU time (median over reps)."""
    import seqpar

    from ...attention.kernels import default_scale, get_kernel
    from ...attention.usp import usp_attention

    world = dist.get_world_size()
    mesh = seqpar.init_mesh(world, ulysses_degree=1, ring_degree=world, layout=layout)
    q, k, v = (seqpar.shard(t, mesh) for t in qkv(seq, heads, heads, d, torch.float32, seed=1))
    cpu, wall, flops, calls = [], [], 0.0, 0
    for _ in range(reps + 1):  # first rep warms up
        kern = TimingKernel(get_kernel(q.device, "cpu"))
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            usp_attention(q, k, v, mesh, seq, True, default_scale(d), kern)
        wall.append(time.perf_counter() - t0)
        cpu.append(kern.cpu_s)
        flops, calls = kern.flops, kern.calls
    return {
        "kernel_cpu_s": statistics.median(cpu[1:]),
        "fwd_wall_s": statistics.median(wall[1:]),
        "executed_flops": flops,
        "kernel_calls": calls,
    }


def shape_prediction(seq: int, r: int, heads: int, d: int, reps: int) -> dict[str, Any]:
    """Per-rank kernel CPU time predicted from the plan: time each distinct piece shape once, in this
    process with 1 thread, and add up each rank's pieces. Separates the kernel's per-shape
    efficiency (causal diagonals, q-short vs kv-short blocks) from noise in the 4-rank measurement."""
    from ...attention.kernels import default_scale, get_kernel
    from ...attention.ring import plan_pieces
    from ...layout import ring_segments

    kern = get_kernel(torch.device("cpu"), "cpu")
    shapes_per_rank: dict[str, list[list[tuple[int, int, bool]]]] = {}
    for layout in ("contiguous", "zigzag"):
        segs = [ring_segments(seq, r, j, layout) for j in range(r)]
        shapes_per_rank[layout] = [
            [(p.q1 - p.q0, p.k1 - p.k0, p.causal) for j in range(r) for p in plan_pieces(segs[me], segs[j], True)]
            for me in range(r)
        ]
    shapes = sorted({sh for per in shapes_per_rank.values() for lst in per for sh in lst})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = {}
    try:
        g = torch.Generator().manual_seed(4)
        for sq, sk, causal in shapes:
            q = torch.randn(1, sq, heads, d, generator=g)
            k, v = torch.randn(1, sk, heads, d, generator=g), torch.randn(1, sk, heads, d, generator=g)
            ts = []
            for _ in range(reps + 1):
                t0 = time.thread_time()
                kern.forward(q, k, v, causal, default_scale(d))
                ts.append(time.thread_time() - t0)
            times[(sq, sk, causal)] = statistics.median(ts[1:])
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {
        "kernel_shape_cpu_s": [{"q_len": a, "kv_len": b, "causal": c, "cpu_s": t} for (a, b, c), t in times.items()]
    }
    for layout, per in shapes_per_rank.items():
        pred = [sum(times[sh] for sh in lst) for lst in per]
        out[layout] = {
            "predicted_kernel_cpu_s_per_rank": pred,
            "predicted_max_over_mean_cpu": max(pred) / statistics.fmean(pred),
        }
    return out


def balance_section(per_rank: list, seq: int, heads: int, d: int, reps: int) -> dict[str, Any]:
    """The JSON document's "load_balance" part: the plan at S=8192 and R in {2, 4, 8}, the 4-rank measurement
    (per_rank: each rank's `measure_balance` per layout) and the per-shape prediction (timed here)."""
    pred = shape_prediction(seq, 4, heads, d, reps)
    layouts = {}
    for layout in ("contiguous", "zigzag"):
        cpu = [pr["balance"][layout]["kernel_cpu_s"] for pr in per_rank]
        fl = [pr["balance"][layout]["executed_flops"] for pr in per_rank]
        layouts[layout] = {
            "kernel_cpu_s_per_rank": cpu,
            "max_over_mean_cpu": max(cpu) / statistics.fmean(cpu),
            "executed_flops_per_rank": fl,
            "max_over_mean_flops": max(fl) / statistics.fmean(fl),
            "planned_flops_per_rank": flops_per_rank(seq, 4, layout, heads, d),
            "kernel_calls_per_rank": [pr["balance"][layout]["kernel_calls"] for pr in per_rank],
            "fwd_wall_s_per_rank": [pr["balance"][layout]["fwd_wall_s"] for pr in per_rank],
            **pred[layout],
        }
    return {
        "description": "causal forward FLOPs per ring rank from ring.plan_pieces; measured at R=4",
        "planned": {"seq_len": 8192, "heads": 8, "head_dim": 64, "rows": load_balance_table(8192, 8, 64)},
        "measured": {
            "ring_degree": 4,
            "seq_len": seq,
            "heads": heads,
            "head_dim": d,
            "reps": reps,
            "dtype": "float32",
            "layouts": layouts,
            "kernel_shape_cpu_s": pred["kernel_shape_cpu_s"],
        },
    }


def balance_lines(section: dict[str, Any]) -> list[str]:
    """Markdown tables of the "load_balance" part: planned, measured, per piece shape."""
    out = ["", "### Causal load balance (forward FLOPs per ring rank, from the ring's piece plan)", ""]
    pl = section["planned"]
    out.append(f"S={pl['seq_len']}, H={pl['heads']}, D={pl['head_dim']}.")
    out.append("")
    out.append("| R | layout | max/mean | (2R-1)/R | per-rank GFLOP |")
    out.append("|---:|---|---:|---:|---|")
    for r in pl["rows"]:
        per = ", ".join(f"{f / 1e9:.2f}" for f in r["flops_per_rank"])
        out.append(
            f"| {r['ring_degree']} | {r['layout']} | {r['max_over_mean']:.3f} | "
            f"{(2 * r['ring_degree'] - 1) / r['ring_degree']:.3f} | {per} |"
        )
    m = section["measured"]
    out += [
        "",
        f"Measured at R=4, S={m['seq_len']}, H={m['heads']}, D={m['head_dim']}, fp32, forward, median of {m['reps']}:",
        "",
    ]
    out.append(
        "| layout | kernel CPU s per rank | max/mean CPU | predicted per rank (from shapes) | max/mean predicted "
        "| max/mean executed FLOPs | kernel calls per rank |"
    )
    out.append("|---|---|---:|---|---:|---:|---|")
    for layout, v in m["layouts"].items():
        cpu = ", ".join(f"{x:.3f}" for x in v["kernel_cpu_s_per_rank"])
        pr = ", ".join(f"{x:.3f}" for x in v["predicted_kernel_cpu_s_per_rank"])
        out.append(
            f"| {layout} | {cpu} | {v['max_over_mean_cpu']:.3f} | {pr} | {v['predicted_max_over_mean_cpu']:.3f} | "
            f"{v['max_over_mean_flops']:.3f} | {v['kernel_calls_per_rank']} |"
        )
    out += ["", "Kernel CPU time per piece shape (one process, 1 thread; FLOPs: causal counts half):", ""]
    out.append("| q len | kv len | causal | CPU ms | ns per FLOP |")
    out.append("|---:|---:|---|---:|---:|")
    for sh in m["kernel_shape_cpu_s"]:
        area = sh["q_len"] * (sh["q_len"] + 1) / 2 if sh["causal"] else sh["q_len"] * sh["kv_len"]
        fl = 4.0 * m["heads"] * m["head_dim"] * area
        out.append(
            f"| {sh['q_len']} | {sh['kv_len']} | {sh['causal']} | {sh['cpu_s'] * 1e3:.2f} | "
            f"{sh['cpu_s'] / fl * 1e9:.3f} |"
        )
    return out
