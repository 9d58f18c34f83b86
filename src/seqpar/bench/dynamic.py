"""Length-aware SP benchmark (`python -m seqpar.bench dynamic`): tokens/s of `size: dynamic` against the fixed SP size
the longest row needs, on a long-tailed SFT mix, measured side by side on this CPU with 4 gloo ranks, and predicted
by the planner for 8 H100 / 8 H200.

Measured: one 4-rank world (1 thread per rank) trains, per round, the fixed run (size 4: one row per micro-batch),
the fixed run with `dataset.packing: true` (rows packed to max_length), and the dynamic run, one after the other
(the configurations alternate under the same machine load), each `steps` steps of the same rows (the packed run
takes its packs); the first step of each run is not timed. Per run: tokens / seconds over its timed steps; per
configuration the median over rounds; the ratios are taken per round (same load) and their median reported, by wall
clock and by CPU time (tokens per CPU second of the busiest rank, `step_cpu_s`: the work, whatever the load).

Predicted: `seqpar plan --lengths` (planner.lengths.plan_mix) for Llama-3.1-8B, SFT, full fine-tuning, bf16 on 8
H100 and 8 H200, for the issue's mix: 90% of rows 256-4096 tokens, 9% 4096-32768, 1% 120000-131072 (log-uniform
within each bucket), 64 rows per step; the fixed layout is the one the planner recommends for the longest row.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["MODEL", "MIX", "run", "summary_lines", "plot_dynamic"]

MODEL = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 32, "hidden_size": 256, "intermediate_size": 768,
         "num_layers": 4}
MIX = "0.88:32-384,0.10:384-1024,0.02:2048"  # rows of the measured mix (max_length 2048)
MAX_LENGTH, MAX_LOCAL, ROWS_PER_STEP = 2048, 512, 16
PLANNER_MIX = "0.9:256-4096,0.09:4096-32768,0.01:120000-131072"
_QUICK = {"model": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}, "mix": "0.85:8-32,0.1:32-64,0.05:128",
          "max_length": 128, "max_local": 32, "rows": 8}


def _cfg(q: dict, data: Path, out: Path, kind: str, steps: int) -> dict:
    sp = {"size": "dynamic", "max_local_tokens": q["max_local"]} if kind == "dynamic" else {"size": 4}
    return {"model": {"name": "tiny:llama", "kwargs": q["model"]},
            "dataset": {"path": str(data), "format": "tokenized", "max_length": q["max_length"], "shuffle": False,
                        "packing": kind == "fixed_packed"},
            "sequence_parallel": sp, "precision": "fp32", "micro_batch_size": 1, "grad_accum": q["rows"],
            "max_steps": steps, "output_dir": str(out), "optimizer": {"name": "sgd", "lr": 1e-3},
            "memory": {"measure": False}, "checkpoint": {"resume": False}, "export": {"final": False},
            "progress": False, "seed": 0}


def _rank(jobs: list[tuple[str, dict]]) -> dict[str, list[dict]]:
    """In each rank: train every job; its metrics rows."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.loop.plots import read_metrics
    from seqpar.train.run import train

    torch.set_num_threads(1)
    out = {}
    for key, cfg in jobs:
        res = train(config_from_dict(cfg))
        out[key] = read_metrics(Path(res.metrics_path))
    return out


def _write_rows(path: Path, lengths: list[int]) -> Path:
    import json
    import random

    rng = random.Random(0)
    path.write_text("".join(json.dumps({"input_ids": [rng.randrange(3, 250) for _ in range(n)]}) + "\n"
                            for n in lengths))
    return path


def _measure(q: dict, rounds: int, steps: int, timeout: float, root: Path) -> dict[str, Any]:
    from ..planner.lengths import parse_lengths
    from ..spawn import run_distributed

    lengths = parse_lengths(q["mix"], rows=q["rows"] * steps * 4, seed=1)
    data = _write_rows(root / "rows.jsonl", lengths)
    kinds = ("fixed", "fixed_packed", "dynamic")
    jobs = [(f"{k}/{r}", _cfg(q, data, root / f"{k}_{r}", k, steps)) for r in range(rounds)
            for k in (kinds if r % 2 == 0 else kinds[::-1])]  # the order alternates from round to round
    load = [os.getloadavg()]
    res = run_distributed(_rank, 4, jobs, timeout=timeout)
    load.append(os.getloadavg())
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for key, _ in jobs:
        kind, rnd = key.split("/")
        rows = res[0][key][1:]  # the first step (warm-up) is not timed
        tok, sec = sum(r["tokens"] for r in rows), sum(r["step_s"] for r in rows)
        cpu = sum(r["step_cpu_s"] for r in rows)  # the busiest rank's process CPU s per step: the work, not the load
        run = {"round": int(rnd), "tokens_per_s": tok / sec, "tokens_per_cpu_s": tok / cpu,
               "step_s": [r["step_s"] for r in rows], "step_cpu_s": [r["step_cpu_s"] for r in rows],
               "tokens": [r["tokens"] for r in rows]}
        if kind == "dynamic":
            run.update({k: [r[k] for r in rows] for k in ("sp_degrees", "micro_steps", "rank_s_max", "rank_s_mean",
                                                          "predicted_rank_s_max", "predicted_rank_s_mean")})
        runs[kind].append(run)
    return {"runs": runs, "loadavg_start": list(load[0]), "loadavg_end": list(load[1]), "lengths": lengths}


def _ratios(runs: dict[str, list[dict]]) -> dict[str, Any]:
    by = {k: {r["round"]: r["tokens_per_s"] for r in v} for k, v in runs.items()}
    out: dict[str, Any] = {"median_tokens_per_s": {k: statistics.median(v.values()) for k, v in by.items()}}
    cpu = {k: {r["round"]: r["tokens_per_cpu_s"] for r in v} for k, v in runs.items()}
    for base in ("fixed", "fixed_packed"):
        per = [by["dynamic"][r] / by[base][r] for r in sorted(by["dynamic"])]
        out[f"dynamic_over_{base}"] = {"per_round": per, "median": statistics.median(per)}
        per = [cpu["dynamic"][r] / cpu[base][r] for r in sorted(cpu["dynamic"])]
        out[f"dynamic_over_{base}_cpu_time"] = {"per_round": per, "median": statistics.median(per)}
    return out


def _predict(quick: bool) -> dict[str, Any]:
    from ..planner.gpus import make_cluster
    from ..planner.lengths import parse_lengths, plan_mix
    from ..planner.memory import Workload
    from ..planner.model import load_model_facts
    from ..planner.search import Request

    m = load_model_facts("llama-3.1-8b")
    lengths = parse_lengths(PLANNER_MIX, rows=256 if quick else 1024)
    req = Request(workload=Workload(0, "sft", "full", "bf16"))
    return {gpu: plan_mix(m, make_cluster(8, gpu=gpu), req, lengths, rows_per_step=64) for gpu in ("h100", "h200")}


def run(quick: bool = False, rounds: int = 3, steps: int = 5, timeout: float = 3000.0) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (module docstring)."""
    import seqpar

    q = _QUICK if quick else {"model": MODEL, "mix": MIX, "max_length": MAX_LENGTH, "max_local": MAX_LOCAL,
                              "rows": ROWS_PER_STEP}
    rounds, steps = (1, 2) if quick else (rounds, steps)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="seqpar_bench_dynamic_") as tmp:
        measured = _measure(q, rounds, steps, timeout, Path(tmp))
    return {
        "benchmark": "dynamic", "schema_version": 1, "quick": quick, "seqpar_version": seqpar.__version__,
        "measured": {"world": 4, "threads_per_rank": 1, "precision": "fp32", "model": {"arch": "tiny:llama",
                     **q["model"]}, "mix": q["mix"], "max_length": q["max_length"], "max_local_tokens": q["max_local"],
                     "rows_per_step": q["rows"], "rounds": rounds, "steps_per_run": steps,
                     "fixed": "size 4 (what max_length needs at N): one row per micro-batch; fixed_packed: the same "
                              "with dataset.packing (packs of <= max_length)", **measured,
                     **_ratios(measured["runs"])},
        "predicted": {"model": "llama-3.1-8b", "stage": "sft", "finetuning": "full", "precision": "bf16",
                      "mix": PLANNER_MIX, "rows_per_step": 64, **_predict(quick)},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "note": "2 CPU cores shared with other sessions' work: the configurations alternate within one "
                            "world, ratios are per round"},
        "elapsed_s": time.time() - t0,
    }


def summary_lines(res: dict[str, Any]) -> list[str]:
    m = res["measured"]
    med = m["median_tokens_per_s"]
    lines = [f"Measured (CPU, 4 gloo ranks, 1 thread each, {m['model']['arch']} {m['model']}, mix {m['mix']}, "
             f"max_length {m['max_length']}, N {m['max_local_tokens']}, {m['rows_per_step']} rows per step; "
             f"median of {m['rounds']} round(s); load {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}):", "",
             "| configuration | tokens/s (median) |", "|---|---:|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in med.items()]
    for base in ("fixed", "fixed_packed"):
        r = m[f"dynamic_over_{base}"]
        lines.append(f"\ndynamic / {base}: median x{r['median']:.2f} (rounds: "
                     + ", ".join(f"{x:.2f}" for x in r["per_round"]) + ")")
        if (c := m.get(f"dynamic_over_{base}_cpu_time")) is not None:
            lines.append(f"dynamic / {base} by CPU time (tokens per busiest-rank CPU s): median x{c['median']:.2f} "
                         "(rounds: " + ", ".join(f"{x:.2f}" for x in c["per_round"]) + ")")
    lines += ["", f"Predicted ({res['predicted']['model']}, {res['predicted']['mix']}):", "",
              "| cluster | fixed layout | fixed tok/s | fixed packed tok/s | dynamic tok/s | N | dynamic / fixed | "
              "dynamic / packed |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for gpu in ("h100", "h200"):
        p = res["predicted"][gpu]
        t, fx = p["tokens_per_s"], p["fixed_layout"]
        lines.append(f"| 8 x {gpu} | u{fx['ulysses']} r{fx['ring']} dp{fx['dp']} | {t['fixed']:.0f} | "
                     f"{t.get('fixed_packed', 0):.0f} | {t['dynamic']:.0f} | {p['max_local_tokens']} | "
                     f"{p['speedup_vs_fixed']:.2f} | {p['speedup_vs_fixed_packed'] or 0:.2f} |")
    return lines


def plot_dynamic(res: dict[str, Any], path: str) -> None:
    """Measured tokens/s per configuration (each round a dot, the median a bar) and the predictions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    m = res["measured"]
    kinds = list(m["median_tokens_per_s"])
    a.bar(kinds, [m["median_tokens_per_s"][k] for k in kinds], color=["#999", "#bbb", "#2a7"])
    for i, k in enumerate(kinds):
        a.plot([i] * len(m["runs"][k]), [r["tokens_per_s"] for r in m["runs"][k]], "k.")
    a.set_ylabel("tokens/s")
    a.set_title(f"CPU, 4 ranks: dynamic x{m['dynamic_over_fixed']['median']:.2f} vs fixed, "
                f"x{m['dynamic_over_fixed_packed']['median']:.2f} vs packed")
    gpus = ("h100", "h200")
    for j, k in enumerate(("fixed", "fixed_packed", "dynamic")):
        b.bar([x + 0.27 * (j - 1) for x in range(2)], [res["predicted"][g]["tokens_per_s"][k] / 1e3 for g in gpus],
              width=0.27, label=k, color=["#999", "#bbb", "#2a7"][j])
    b.set_xticks(range(2), [f"8 x {g}" for g in gpus])
    b.set_ylabel("predicted ktokens/s")
    b.set_title(f"planner: {res['predicted']['model']}, SFT mix {res['predicted']['mix']}", fontsize=9)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
