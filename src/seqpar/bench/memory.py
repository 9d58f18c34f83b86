"""Memory benchmark: exact per-rank peak of one SFT train step vs sequence length, SP size and memory features.

Every point is a real `seqpar train` run (`seqpar.train.run.train(cfg)`, max_steps=1, inside a
spawned gloo world of SP ranks) with `memory.measure: true`: the peak is the meter's exact count of
live tensor bytes on each rank (seqpar.memory.meter; split by category at the peak), max over ranks.
It does not depend on machine load. Parts of the JSON document (see `run`):

1. points: peak per (model, SP, feature set, S_local), with the split of the rank with the largest peak.
   The peak is DEVICE bytes; with activation offload the layer inputs held in the host store are
   reported apart (`offloaded_peak_bytes`: the store's peak; `offloaded_at_peak_bytes`: what it held at
   the device peak), max over ranks. On CPU the store is numpy memory the meter does not count.
2. fits: peak = a + b * S_local per (model, SP, feature set) by least squares, with residuals
   (linearity); b = device bytes per local token; `host_fits`: the same for the offloaded peak.
3. max_length: the largest full sequence length whose predicted peak fits `budget_gib` per rank, per
   (model, SP, feature set); one of them confirmed by a measured step (`confirmation` says which).
4. activation_ratio: activation bytes (peak minus parameters, buffers, gradients, optimizer state)
   at SP=4 over SP=1 at one full length present in both grids (ideal: 1/4), and from linear fits of the
   activation bytes at the SP=1 max trainable length (`at_max_length`).
5. time_ratio: step time per feature set over no features, from separate runs WITHOUT the meter
   (TIME_STEPS steps; the fastest step after the first is kept) at the largest S_local, all in the same
   benchmark run. Wall times on a shared machine are noisy: compare only numbers from one run.

Feature sets are cumulative: none (fused_loss off too), checkpointing, + fused loss, + tiled MLP,
+ activation offload; they are `memory.*` config keys, so the numbers show whatever those features do in
the installed seqpar. (The tiled decoder layer has its own benchmark, `python -m seqpar.bench layer-memory`;
one more set here would cost every run of the quick smoke test in the default suite.)
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["FEATURE_SETS", "ModelCase", "model_cases", "linear_fit", "run"]

FEATURE_SETS: dict[str, dict[str, Any]] = {
    "none": {"activation_checkpointing": False, "fused_loss": False, "tiled_mlp": False},
    "checkpointing": {"activation_checkpointing": True, "fused_loss": False, "tiled_mlp": False},
    "ckpt+fused_loss": {"activation_checkpointing": True, "fused_loss": True, "tiled_mlp": False},
    "ckpt+fused_loss+tiled_mlp": {"activation_checkpointing": True, "fused_loss": True, "tiled_mlp": True},
    "ckpt+fused_loss+tiled_mlp+offload": {"activation_checkpointing": True, "fused_loss": True, "tiled_mlp": True,
                                          "offload_activations": True},
}
SP_SIZES = (1, 2, 4)
GIB = 2**30
# Fused-loss chunk for every run. The default chunk bounds one chunk's fp32 logits to 256 MB (1365 tokens
# for SmolLM2's 49,152 vocab): at the short lengths measured here a single chunk would then hold ALL local
# logits, and the fit would charge them to b. Chunks smaller than the shortest S_local make the measured
# line the asymptotic one; the default chunk adds a constant (about 3 x 256 MB) once S_local exceeds it.
LOSS_CHUNK_TOKENS = 64
# Timing runs: the first step warms up; the fastest of the others is kept (least disturbed by other load).
TIME_STEPS = 4


@dataclass(frozen=True)
class ModelCase:
    """One model of the benchmark: its config, heads and the per-rank lengths (S_local) it is run at."""

    name: str
    model: dict[str, Any]
    finetuning: dict[str, Any]
    heads: tuple[int, int]
    s_locals: tuple[int, ...]
    confirm_cap: int  # longest full length the confirmation step may use (runs within minutes here)
    description: str = ""
    sp_sizes: tuple[int, ...] = field(default=SP_SIZES)


def model_cases(quick: bool) -> list[ModelCase]:
    tiny_kw = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2, "intermediate_size": 256}
    if quick:  # smoke test: two 2-rank-or-smaller worlds; LoRA so that activations, not AdamW state, dominate
        return [ModelCase("tiny", {"name": "tiny:llama", "kwargs": tiny_kw}, {"method": "lora", "r": 4, "alpha": 8},
                          (4, 2), (64, 128), confirm_cap=512, sp_sizes=(1, 2),
                          description="tiny llama (2 layers, hidden 64), LoRA r=4, fp32 (quick: SP 1 and 2 only)")]
    # the confirmation step runs past the builder's default 4096 positions
    tiny_kw = {**tiny_kw, "num_layers": 4, "max_position_embeddings": 32768}
    return [
        # long enough that activations, not AdamW state, set the peak (else the peak switches moments: not a line)
        ModelCase("tiny", {"name": "tiny:llama", "kwargs": tiny_kw}, {"method": "full"}, (4, 2), (1024, 2048, 4096),
                  confirm_cap=32768, description="tiny llama (4 layers, hidden 64), full fine-tuning, fp32"),
        ModelCase("smollm2", {"name": "smollm2"}, {"method": "lora", "r": 8, "alpha": 16}, (9, 3), (128, 256, 512),
                  confirm_cap=8192, description="SmolLM2-135M-Instruct, LoRA r=8 (q,k,v,o), fp32"),
    ]


def linear_fit(xs: list[float], ys: list[float]) -> dict[str, Any]:
    """Least squares y = a + b x, with residuals (an exact line has all residuals 0)."""
    if len(xs) < 2:
        raise ValueError("a line needs at least two lengths")
    b, a = statistics.linear_regression(xs, ys)
    res = [y - (a + b * x) for x, y in zip(xs, ys)]
    return {"a_bytes": a, "b_bytes_per_token": b, "residuals_bytes": res,
            "max_abs_residual_bytes": max(abs(r) for r in res),
            "max_rel_residual": max(abs(r) / y for r, y in zip(res, ys)), "points": len(xs),
            "note": "2 points: a line through them, residuals are 0 by construction" if len(xs) == 2 else ""}


def write_token_rows(root: Path, full_len: int, rows: int = 2) -> Path:
    """`rows` tokenized rows of exactly full_len tokens (ids valid for every model here), all supervised."""
    path = root / f"rows_{full_len}x{rows}.jsonl"
    if not path.exists():
        rng = random.Random(full_len)
        path.write_text("".join(json.dumps({"input_ids": [rng.randrange(3, 250) for _ in range(full_len)]}) + "\n"
                                for _ in range(rows)))
    return path


def _cfg(mc: ModelCase, sp: int, full_len: int, fs: str, data: Path, out: Path, steps: int, measure: bool) -> dict:
    return {
        "model": mc.model, "finetuning": mc.finetuning,
        "dataset": {"path": str(data), "format": "tokenized", "max_length": full_len, "shuffle": False},
        "sequence_parallel": {"size": sp}, "precision": "fp32", "micro_batch_size": 1, "grad_accum": 1,
        "max_steps": steps, "output_dir": str(out),
        "memory": {**FEATURE_SETS[fs], "loss_chunk_tokens": LOSS_CHUNK_TOKENS, "measure": measure},
        "checkpoint": {"resume": False}, "progress": False, "seed": 0,
    }


def _rank_runs(jobs: list[tuple[str, dict]]) -> dict[str, dict[str, Any]]:
    """In each rank of a spawned world: train every job's config; this rank's meter readings + step times."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.loop.plots import read_metrics
    from seqpar.train.run import train

    out = {}
    for key, cfg in jobs:
        res = train(config_from_dict(cfg))
        rows = read_metrics(Path(cfg["output_dir"]) / "metrics.jsonl")
        out[key] = {"reading": res.peak_alloc[-1] if res.peak_alloc else None,
                    "step_s": min(r["step_s"] for r in rows[1:] or rows),
                    "peak_alloc_mb": rows[-1].get("peak_alloc_mb"), "mesh": res.mesh}
    return out


def _point(mc: ModelCase, sp: int, fs: str, s_local: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    from seqpar.memory.meter import activation_bytes

    readings = [r["reading"] for r in per_rank]
    top = max(range(len(readings)), key=lambda i: readings[i]["peak_bytes"])
    return {
        "model": mc.name, "sp": sp, "feature_set": fs, "s_local": s_local, "full_length": s_local * sp,
        "mesh": per_rank[0]["mesh"], "peak_bytes": readings[top]["peak_bytes"],
        "per_rank_peak_bytes": [r["peak_bytes"] for r in readings], "peak_rank": top,
        "by_category": readings[top]["by_category"], "activation_bytes": max(activation_bytes(r) for r in readings),
        "offloaded_peak_bytes": max(r.get("offloaded_peak_bytes", 0) for r in readings),
        "offloaded_at_peak_bytes": max(r.get("offloaded_at_peak_bytes", 0) for r in readings),
        "step_s_with_meter": max(r["step_s"] for r in per_rank), "source": readings[top]["source"],
    }


def _measure_grid(mc: ModelCase, sp: int, root: Path, timeout: float) -> tuple[list[dict], dict[str, float]]:
    """One world of `sp` ranks: the measured grid (1 step each) and the unmeasured timing runs (2 steps)."""
    from seqpar.spawn import run_distributed

    jobs = []
    for fs in FEATURE_SETS:
        for s in mc.s_locals:
            data = write_token_rows(root, s * sp)
            jobs.append((f"mem/{fs}/{s}", _cfg(mc, sp, s * sp, fs, data, root / f"{mc.name}_sp{sp}_{fs}_{s}", 1, True)))
    s_time = max(mc.s_locals)
    for fs in FEATURE_SETS:
        data = write_token_rows(root, s_time * sp)
        out = root / f"{mc.name}_sp{sp}_{fs}_t"
        jobs.append((f"time/{fs}", _cfg(mc, sp, s_time * sp, fs, data, out, TIME_STEPS, False)))
    ranks = run_distributed(_rank_runs, sp, jobs, timeout=timeout)
    points = [_point(mc, sp, fs, s, [r[f"mem/{fs}/{s}"] for r in ranks]) for fs in FEATURE_SETS for s in mc.s_locals]
    times = {fs: max(r[f"time/{fs}"]["step_s"] for r in ranks) for fs in FEATURE_SETS}
    return points, times


def _max_length(mc: ModelCase, sp: int, fit: dict[str, Any], budget: float) -> dict[str, Any]:
    from seqpar.layout import required_multiple
    from seqpar.train.config import SequenceParallelSpec, resolve_sp_degrees

    u, r = resolve_sp_degrees(SequenceParallelSpec(size=sp), *mc.heads)
    mult = required_multiple(r, u, "zigzag" if r > 1 else "contiguous")
    a, b = fit["a_bytes"], fit["b_bytes_per_token"]
    s_local = (budget - a) / b if b > 0 else float("inf")
    full = int(s_local * sp) // mult * mult if s_local != float("inf") else None
    return {"ulysses": u, "ring": r, "multiple": mult, "max_s_local": s_local, "max_full_length": full,
            "fits_at_all": a < budget}


def _confirm(mc: ModelCase, sp: int, fs: str, ml: dict[str, Any], fit: dict[str, Any], root: Path,
             timeout: float) -> dict[str, Any]:
    """One measured step at the largest predicted length (capped at what runs within minutes here)."""
    from seqpar.spawn import run_distributed

    full = min(ml["max_full_length"] or mc.confirm_cap, mc.confirm_cap) // ml["multiple"] * ml["multiple"]
    data = write_token_rows(root, full)
    job = ("confirm", _cfg(mc, sp, full, fs, data, root / f"{mc.name}_confirm", 1, True))
    t0 = time.time()
    ranks = run_distributed(_rank_runs, sp, [job], timeout=timeout)
    pt = _point(mc, sp, fs, full // sp, [r["confirm"] for r in ranks])
    pred = fit["a_bytes"] + fit["b_bytes_per_token"] * (full // sp)
    return {
        "model": mc.name, "sp": sp, "feature_set": fs, "full_length": full,
        "predicted_max_full_length": ml["max_full_length"], "capped": full < (ml["max_full_length"] or 0),
        "cap": mc.confirm_cap, "predicted_peak_bytes": pred, "measured_peak_bytes": pt["peak_bytes"],
        "rel_error": (pt["peak_bytes"] - pred) / pred, "wall_s": time.time() - t0, "point": pt,
    }


def _analyse(mc: ModelCase, points: list[dict], budget: float) -> dict[str, Any]:
    fits, host_fits, max_len, act = {}, {}, {}, {}
    for sp in mc.sp_sizes:
        for fs in FEATURE_SETS:
            pts = sorted((p for p in points if p["sp"] == sp and p["feature_set"] == fs), key=lambda p: p["s_local"])
            fit = linear_fit([p["s_local"] for p in pts], [p["peak_bytes"] for p in pts])
            fits[f"sp{sp}/{fs}"] = fit
            if any(p["offloaded_peak_bytes"] for p in pts):
                host_fits[f"sp{sp}/{fs}"] = linear_fit([p["s_local"] for p in pts],
                                                       [p["offloaded_peak_bytes"] for p in pts])
            max_len[f"sp{sp}/{fs}"] = _max_length(mc, sp, fit, budget)
    lo, hi = min(mc.sp_sizes), max(mc.sp_sizes)
    common = sorted({p["full_length"] for p in points if p["sp"] == lo} & {p["full_length"] for p in points
                                                                          if p["sp"] == hi})
    if common and hi != lo:
        L = common[-1]
        for fs in FEATURE_SETS:
            a_lo, a_hi = (next(p["activation_bytes"] for p in points
                               if p["sp"] == s and p["feature_set"] == fs and p["full_length"] == L) for s in (lo, hi))
            act[fs] = {"full_length": L, f"sp{lo}_bytes": a_lo, f"sp{hi}_bytes": a_hi, "ratio": a_hi / a_lo,
                       "ideal": lo / hi, "at_max_length": _ratio_at_max_length(points, max_len, fs, lo, hi)}
    return {"fits": fits, "host_fits": host_fits, "max_length": max_len, "activation_ratio": act}


def _ratio_at_max_length(points: list[dict], max_len: dict[str, Any], fs: str, lo: int, hi: int) -> dict | None:
    """Activation SP=hi / SP=lo at the SP=lo max trainable length, from linear fits of the activation bytes.

    A constant working set (one loss chunk, one recomputed layer) is not divided by SP, so at short
    lengths the ratio sits above 1/SP; at the lengths the features are for, the per-token part dominates.
    """
    L = max_len[f"sp{lo}/{fs}"]["max_full_length"]
    if not L:
        return None
    act = {}
    for s in (lo, hi):
        pts = sorted((p for p in points if p["sp"] == s and p["feature_set"] == fs), key=lambda p: p["s_local"])
        fit = linear_fit([p["s_local"] for p in pts], [p["activation_bytes"] for p in pts])
        act[s] = fit["a_bytes"] + fit["b_bytes_per_token"] * L / s
    return {"full_length": L, f"sp{lo}_bytes": act[lo], f"sp{hi}_bytes": act[hi], "ratio": act[hi] / act[lo],
            "source": "linear fits of the measured activation bytes, evaluated at the SP=1 max full length"}


def _machine(load_start: tuple[float, float, float]) -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()),
            "note": "peaks are exact tensor byte counts (independent of load); times are wall clock on a shared "
                    "machine, 1 thread per rank: compare only ratios from the same run"}


def run(quick: bool = False, budget_gib: float = 4.0, timeout: float = 1800.0,
        models: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (see the module docstring)."""
    import seqpar

    t_start, load_start = time.time(), os.getloadavg()
    budget = budget_gib * GIB
    cases = [m for m in model_cases(quick) if models is None or m.name in models]
    if not cases:
        raise ValueError(f"models={models}: choose from {[m.name for m in model_cases(quick)]}")
    out: dict[str, Any] = {"benchmark": "memory", "schema_version": 1, "quick": quick, "seqpar_version":
                           seqpar.__version__, "created_unix": t_start, "budget_gib": budget_gib,
                           "feature_sets": FEATURE_SETS, "models": {}}
    with tempfile.TemporaryDirectory(prefix="seqpar_bench_memory_") as tmp:
        root = Path(tmp)
        for mc in cases:
            points, times = [], {}
            for sp in mc.sp_sizes:
                pts, t = _measure_grid(mc, sp, root, timeout)
                points += pts
                times[f"sp{sp}"] = {"step_s": t, "ratio_vs_none": {fs: v / t["none"] for fs, v in t.items()},
                                    "s_local": max(mc.s_locals)}
            res = _analyse(mc, points, budget)
            sp = max(mc.sp_sizes)
            # on ties the set with more features on (the later one): it is the one users would run
            best = max(reversed(FEATURE_SETS), key=lambda fs: res["max_length"][f"sp{sp}/{fs}"]["max_full_length"] or 0)
            key = f"sp{sp}/{best}"
            conf = (_confirm(mc, sp, best, res["max_length"][key], res["fits"][key], root, timeout)
                    if res["max_length"][key]["fits_at_all"] else None)
            out["models"][mc.name] = {"description": mc.description, "heads": list(mc.heads),
                                      "s_locals": list(mc.s_locals), "sp_sizes": list(mc.sp_sizes), "points": points,
                                      **res, "time": times, "confirmation": conf}
    out["machine"] = _machine(load_start)
    out["elapsed_s"] = time.time() - t_start
    return out


def summary_lines(res: dict[str, Any]) -> list[str]:
    """Markdown tables: bytes per local token, max length under the budget, activation and time ratios."""
    lines = []
    for name, m in res["models"].items():
        lines += [f"### {name}: {m['description']}", "",
                  f"| SP | feature set | device b (KiB / local token) | a (MiB) | max rel. residual | host b (KiB / "
                  f"local token) | max full length @ {res['budget_gib']:g} GiB/rank | time / none |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for key, fit in m["fits"].items():
            sp, fs = key.split("/", 1)
            ml = m["max_length"][key]["max_full_length"]
            tr = m["time"][sp]["ratio_vs_none"][fs]
            host = m.get("host_fits", {}).get(key)
            hb = f"{host['b_bytes_per_token'] / 1024:.1f}" if host else "0"
            lines.append(f"| {sp[2:]} | {fs} | {fit['b_bytes_per_token'] / 1024:.1f} | {fit['a_bytes'] / 2**20:.1f} | "
                         f"{fit['max_rel_residual']:.2e} | {hb} | {ml if ml is not None else 'unbounded'} | {tr:.2f} |")
        lines.append("")
        for fs, a in m["activation_ratio"].items():
            lo, hi = min(m["sp_sizes"]), max(m["sp_sizes"])
            far = a.get("at_max_length")
            lines.append(f"- activation memory SP={hi} / SP={lo} at {a['full_length']} tokens, {fs}: "
                         f"{a['ratio']:.3f} (ideal {a['ideal']:.3f})"
                         + (f"; at {far['full_length']} tokens (fit): {far['ratio']:.3f}" if far else ""))
        c = m["confirmation"]
        if c:
            lines.append(f"- confirmed: SP={c['sp']} {c['feature_set']} at {c['full_length']} tokens "
                         f"(predicted max {c['predicted_max_full_length']}{', capped' if c['capped'] else ''}): "
                         f"measured {c['measured_peak_bytes'] / 2**20:.1f} MiB vs predicted "
                         f"{c['predicted_peak_bytes'] / 2**20:.1f} MiB ({c['rel_error']:+.2%})")
        lines.append("")
    return lines
