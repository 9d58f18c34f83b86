"""Step benchmark: tokens/s of one full SFT train step at SP=1 and SP=2, side by side in one run.

Every point is a real `seqpar train` step (`seqpar.train.run.train(cfg)`, fp32, micro batch 1, 1 thread
per rank) of the SmolLM2-135M architecture with random weights (`tiny:llama` with SmolLM2-135M's sizes:
30 layers, hidden 576, 9 q / 3 kv heads of 64, MLP 1536, vocab 49,152), for LoRA and full fine-tuning,
with and without memory features (activation checkpointing + fused loss; the memory meter off).
Per round one SP=1 world, then one SP=2 world, runs every configuration (`rounds` rounds: the sizes
alternate under the same machine load); per point the fastest step after the first of each run is kept.
The figure is tokens/s at SP=2 over SP=1 (ideal 2.0 with a free core per rank). `profile`: one extra
LoRA run per SP size under torch.profiler, self time per step by category (attention kernel,
collectives, matmuls, other ops, and the rest: Python and waiting).
"""

from __future__ import annotations

import os
import platform
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .memory import write_token_rows

__all__ = ["SMOLLM2_135M", "FEATURES", "run", "summary_lines"]

SMOLLM2_135M = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "num_layers": 30, "hidden_size": 576,
                "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
                "tie_word_embeddings": True, "rope_theta": 100000.0, "sliding_window": None}
_QUICK_MODEL = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2, "intermediate_size": 128}
FEATURES = {
    "none": {"activation_checkpointing": False, "fused_loss": False, "measure": False},
    "memory": {"activation_checkpointing": True, "fused_loss": True, "measure": False},
}
FINETUNING = {"lora": {"method": "lora", "r": 8, "alpha": 16}, "full": {"method": "full"}}


def _cfg(model: dict, ft: str, fs: str, sp: int, full_len: int, data: Path, out: Path, steps: int) -> dict:
    return {
        "model": {"name": "tiny:llama", "kwargs": model}, "finetuning": FINETUNING[ft],
        "dataset": {"path": str(data), "format": "tokenized", "max_length": full_len, "shuffle": False},
        "sequence_parallel": {"size": sp}, "precision": "fp32", "micro_batch_size": 1, "grad_accum": 1,
        "max_steps": steps, "output_dir": str(out), "memory": FEATURES[fs],
        "checkpoint": {"resume": False}, "progress": False, "seed": 0,
    }


_CATEGORIES = (("attention_kernel", ("flash_attention",)), ("collectives", ("c10d::", "alltoall", "allreduce")),
               ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")))


def _category(key: str) -> str:
    for name, needles in _CATEGORIES:
        if any(n in key for n in needles):
            return name
    return "other_ops" if key.startswith("aten::") else "python_and_wait"


def _mesh_label(mesh: Any) -> str:
    """'ulysses=2 ring=1' from the run's mesh description."""
    text = str(mesh)
    found = {k: re.search(k + r"=(\d+)", text) for k in ("ulysses", "ring")}
    return " ".join(f"{k}={m.group(1)}" for k, m in found.items() if m)


def _rank_jobs(jobs: list[tuple[str, dict, bool]]) -> dict[str, dict[str, Any]]:
    """In each rank: train every job; its step times (and a categorised profile for profiled jobs)."""
    from seqpar.train.config import config_from_dict
    from seqpar.train.loop.plots import read_metrics
    from seqpar.train.run import train

    torch.set_num_threads(1)
    out = {}
    for key, cfg, profiled in jobs:
        if profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                res = train(config_from_dict(cfg))
        else:
            res = train(config_from_dict(cfg))
        rows = read_metrics(Path(cfg["output_dir"]) / "metrics.jsonl")
        entry = {"step_s": [r["step_s"] for r in rows], "step_cpu_s": [r["step_cpu_s"] for r in rows],
                 "tokens": rows[-1]["tokens"], "mesh": res.mesh}
        if profiled:
            cats: dict[str, float] = {}
            for e in prof.key_averages():
                cats[_category(e.key)] = cats.get(_category(e.key), 0.0) + e.self_cpu_time_total / 1e6
            entry["profile_s"] = cats
        out[key] = entry
    return out


def run(quick: bool = False, rounds: int = 2, steps: int = 3, seq_len: int | None = None,
        timeout: float = 3000.0, profile: bool = True) -> dict[str, Any]:
    """Run the benchmark and return the JSON-ready result (see the module docstring)."""
    import seqpar
    from seqpar.spawn import run_distributed

    model = _QUICK_MODEL if quick else SMOLLM2_135M
    full_len = seq_len or (128 if quick else 1024)
    rounds, steps = (1, 2) if quick else (rounds, steps)
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    t_start, load_start, loads = time.time(), os.getloadavg(), []
    prof: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="seqpar_bench_step_") as tmp:
        root = Path(tmp)
        data = write_token_rows(root, full_len, rows=8)
        for rnd in range(rounds):
            for sp in (1, 2):  # one world per SP size and round; the sizes alternate
                jobs = [(f"{ft}/{fs}/sp{sp}", _cfg(model, ft, fs, sp, full_len, data, root / f"{ft}_{fs}_{sp}_{rnd}",
                                                   steps), False) for ft in FINETUNING for fs in FEATURES]
                if profile and rnd == rounds - 1:
                    jobs.append((f"profile/sp{sp}", _cfg(model, "lora", "none", sp, full_len, data,
                                                         root / f"prof_{sp}", steps), True))
                res = run_distributed(_rank_jobs, sp, jobs, timeout=timeout)
                loads.append(os.getloadavg()[0])
                for key, _, profiled in jobs:
                    if profiled:
                        cats = {c for r in res for c in r[key]["profile_s"]}
                        prof[f"sp{sp}"] = {c: max(r[key]["profile_s"].get(c, 0.0) for r in res) / steps for c in cats}
                        continue
                    step_s = [max(r[key]["step_s"][i] for r in res) for i in range(steps)]  # slowest rank
                    times.setdefault(key, []).extend(step_s[1:])
                    cpu.setdefault(key, []).extend(res[0][key]["step_cpu_s"][1:])  # already the max over ranks
                    info[key] = {"mesh": _mesh_label(res[0][key]["mesh"]), "tokens_per_step": res[0][key]["tokens"]}
    points = {}
    for key, ts in times.items():
        best = min(ts)
        points[key] = {**info[key], "step_s": ts, "best_step_s": best, "tokens_per_s": full_len / best,
                       "step_cpu_s": cpu[key], "best_step_cpu_s": min(cpu[key])}
    pairs = [(f"{ft}/{fs}", points[f"{ft}/{fs}/sp1"], points[f"{ft}/{fs}/sp2"]) for ft in FINETUNING for fs in FEATURES]
    ratios = {k: p2["tokens_per_s"] / p1["tokens_per_s"] for k, p1, p2 in pairs}
    # The load-robust view: SP=1's CPU s per step over the busiest SP=2 rank's (1 thread each: the work split)
    cpu_ratios = {k: p1["best_step_cpu_s"] / p2["best_step_cpu_s"] for k, p1, p2 in pairs}
    return {
        "benchmark": "step", "schema_version": 1, "quick": quick, "seqpar_version": seqpar.__version__,
        "model": {"arch": "llama (SmolLM2-135M sizes, random init)" if not quick else "tiny llama", **model},
        "seq_len": full_len, "rounds": rounds, "steps_per_run": steps, "threads_per_rank": 1, "precision": "fp32",
        "points": points, "sp2_over_sp1_tokens_per_s": ratios, "sp1_over_sp2_step_cpu_s": cpu_ratios,
        "profile_per_step_s": {"config": "lora/none", "note": "self CPU time of the slowest rank per category, "
                               "incl. model build and the first step, divided by steps", **prof},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_start": list(load_start), "loadavg_after_each_run": loads,
                    "loadavg_end": list(os.getloadavg()),
                    "note": "2 CPU cores shared with other work; SP=2 needs both cores, so load from others "
                            "costs SP=2 more than SP=1: the ratio is a lower bound on a quiet machine"},
        "elapsed_s": time.time() - t_start,
    }


def summary_lines(res: dict[str, Any]) -> list[str]:
    """Markdown table: tokens/s per configuration at SP=1 and SP=2, and the ratio."""
    lines = [f"S={res['seq_len']}, {res['model']['arch']}, fp32, 1 thread per rank; best step of "
             f"{res['rounds']} round(s) x {res['steps_per_run'] - 1} timed step(s)", "",
             "| fine-tuning | features | SP=1 tokens/s | SP=2 tokens/s | SP=2 / SP=1 | SP=2 mesh | SP=1 / SP=2 CPU s "
             "per step |", "|---|---|---:|---:|---:|---|---:|"]
    for key, ratio in res["sp2_over_sp1_tokens_per_s"].items():
        ft, fs = key.split("/")
        p1, p2 = res["points"][f"{key}/sp1"], res["points"][f"{key}/sp2"]
        lines.append(f"| {ft} | {fs} | {p1['tokens_per_s']:.1f} | {p2['tokens_per_s']:.1f} | {ratio:.3f} | "
                     f"{p2['mesh']} | {res['sp1_over_sp2_step_cpu_s'][key]:.3f} |")
    prof = res["profile_per_step_s"]
    sps = [k for k in ("sp1", "sp2") if k in prof]
    if sps:
        cats = sorted({c for k in sps for c in prof[k]})
        lines += ["", f"Where a step's time goes ({prof['config']}, s per step, {prof['note']}):", "",
                  "| category | " + " | ".join(sps) + " |", "|---|" + "---:|" * len(sps)]
        lines += [f"| {c} | " + " | ".join(f"{prof[k].get(c, 0.0):.2f}" for k in sps) + " |" for c in cats]
    return lines
