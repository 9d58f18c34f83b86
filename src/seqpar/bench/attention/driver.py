"""The attention benchmark's driver: the sizes of a run, the two spawned worlds (4 ranks: parts 1 and 2; 2 ranks:
part 3), and the JSON document `run` returns (see the package docstring)."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .balance import balance_section, measure_balance
from .comm import comm_cases, comm_section, ds_runs_safely, measure_comm, measure_deepspeed, run_deepspeed_alone
from .timing import rank_timing, timing_section

__all__ = ["Sizes", "run", "rank_comm_and_balance", "machine_lines", "machine_info"]


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one benchmark run (`quick` keeps everything tiny for the smoke test)."""

    comm_seq: int
    comm_head_dim: int
    lb_seq: int
    lb_heads: int
    lb_head_dim: int
    lb_reps: int
    time_seq: int
    time_heads: int
    time_head_dim: int
    time_reps: int

    @staticmethod
    def for_mode(quick: bool) -> Sizes:
        if quick:
            return Sizes(64, 16, 256, 2, 16, 1, 256, 4, 16, 2)
        return Sizes(1024, 64, 4096, 8, 64, 5, 8192, 8, 64, 8)



def rank_comm_and_balance(
    seq: int, d: int, cases: list[dict], lb: tuple[int, int, int, int], use_ds: bool
) -> dict[str, Any]:
    import seqpar

    meshes = {}
    for c in cases:
        key = (c["ulysses_degree"], c["ring_degree"])
        if key not in meshes:  # same order on every rank: mesh creation is collective
            meshes[key] = seqpar.init_mesh(dist.get_world_size(), ulysses_degree=key[0], ring_degree=key[1])
    comm = [measure_comm(c, seq, d, meshes) for c in cases]
    lb_seq, lb_heads, lb_d, reps = lb
    balance = {layout: measure_balance(layout, lb_seq, lb_heads, lb_d, reps) for layout in ("contiguous", "zigzag")}
    ds = {}
    if use_ds:
        from ..peers import setup_deepspeed

        setup_deepspeed()
        for i, c in enumerate(cases):
            if c["mode"] == "ulysses" and ds_runs_safely(c):
                ds[i] = measure_deepspeed(c, seq, d, meshes[(c["ulysses_degree"], c["ring_degree"])])
    return {"comm": comm, "balance": balance, "deepspeed": ds}


def _ds_version() -> str:
    from importlib.metadata import version

    return version("deepspeed")


def machine_info(load_start: tuple[float, float, float]) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "note": (
            "2 CPU cores shared with other concurrent work (other test runs); gloo over loopback; "
            "1 thread per rank. 4-rank runs oversubscribe the 2 cores, so part 2 reports per-rank "
            "kernel CPU time (time.thread_time), not wall time. Timings are noisy: compare only "
            "numbers from the same run."
        ),
    }


def run(quick: bool = False, timeout: float = 540.0, peers: str = "auto") -> dict[str, Any]:
    """Run all three parts and return the JSON-ready result.

    peers: "auto" (DeepSpeed Ulysses side by side when it is installed), "deepspeed" (required), "none".
    """
    import seqpar
    from seqpar.spawn import run_distributed

    from ..peers import deepspeed_available

    if peers not in ("auto", "deepspeed", "none"):
        raise ValueError(f"peers={peers!r}: use 'auto', 'deepspeed' or 'none'")
    use_ds = peers != "none" and deepspeed_available()
    if peers == "deepspeed" and not use_ds:
        raise RuntimeError("peers='deepspeed' but deepspeed is not installed: pip install deepspeed")

    sz = Sizes.for_mode(quick)
    t_start = time.time()
    load_start = os.getloadavg()
    cases = comm_cases(quick)
    lb = (sz.lb_seq, sz.lb_heads, sz.lb_head_dim, sz.lb_reps)
    per_rank = run_distributed(
        rank_comm_and_balance, 4, sz.comm_seq, sz.comm_head_dim, cases, lb, use_ds, timeout=timeout
    )
    alone = run_deepspeed_alone(cases, sz.comm_seq, sz.comm_head_dim, timeout) if use_ds else {}
    timing = run_distributed(
        rank_timing, 2, sz.time_seq, sz.time_heads, sz.time_head_dim, sz.time_reps, use_ds, timeout=timeout
    )[0]
    return {
        "benchmark": "attention",
        "schema_version": 1,
        "quick": quick,
        "peers": {"deepspeed": _ds_version() if use_ds else None},
        "seqpar_version": seqpar.__version__,
        "created_unix": t_start,
        "machine": machine_info(load_start),
        "comm_bytes": comm_section(cases, per_rank, sz.comm_seq, sz.comm_head_dim, alone),
        "load_balance": balance_section(per_rank, *lb),
        "timing": timing_section(timing, sz.time_seq, sz.time_heads, sz.time_head_dim, sz.time_reps),
        "elapsed_s": time.time() - t_start,
    }


def machine_lines(res: dict[str, Any]) -> list[str]:
    """The summary's last line: the machine and its load during the run."""
    mc, t = res["machine"], res["timing"]
    return [
        "",
        f"Machine: {mc['cpu_count']} CPUs, {mc['processor']}, torch {mc['torch']}; load average (1 min) "
        f"start {mc['loadavg_start'][0]:.2f}, end {mc['loadavg_end'][0]:.2f}, during timing "
        f"{', '.join(f'{x:.2f}' for x in t['loadavg_1min_during'])}. Total {res['elapsed_s']:.0f} s.",
    ]
