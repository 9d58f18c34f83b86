"""`seqpar train` on one GPU for `python -m seqpar.bench gpu`: speed, MFU and peak memory vs `seqpar plan`, the
fp32 exactness of the memory features, and (optionally) which tensors are alive at one run's peak.

Model: `tiny:llama` with Llama-3.1-8B's layer shape and 2 layers (hidden 4096, 32 q / 8 kv heads of 128, MLP
14336, vocab 128256, untied), random weights; bf16 with fp32 master weights, fused AdamW, micro batch 1.
Data: rows of random lowercase words (the byte tokenizer: one token per character), each cut to max_length.
Every run is its own process (`python -m seqpar.bench.gpu_train CONFIG [TRACE_JSON]`), so each has its own
CUDA allocator statistics. tokens/s: the median of the steps after the first; peak: the largest per-step
`peak_alloc_mb` (torch.cuda.max_memory_allocated over the step). MFU = model FLOPs / step time / the bf16
matmul rate measured in the same bench run, with model FLOPs per step = 6 * N * T + 6 * L * Hq * D * T^2
(N: parameters in matmuls incl. lm_head, T: tokens; the second term is causal attention, fwd + bwd = 3x fwd;
recomputation by checkpointing is not counted, as MFU conventionally does not).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["RUNS", "train_part", "train_lines", "model_flops", "peak_sites", "MFU_DEFINITION"]

MFU_DEFINITION = ("model FLOPs per step / step time / the bf16 matmul rate measured in the same run; model FLOPs = "
                  "6 * N * T + 6 * L * Hq * D * T^2 (N: matmul parameters incl. lm_head, T: tokens, causal attention "
                  "fwd + bwd = 3x fwd; checkpointing's recomputation not counted)")

LLAMA_2L = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336,
            "num_layers": 2, "vocab_size": 128256, "max_position_embeddings": 262144, "initializer_range": 0.02}
TINY = {"num_heads": 8, "num_kv_heads": 4, "head_dim": 64, "num_layers": 2, "hidden_size": 512,
        "intermediate_size": 1408, "vocab_size": 4096, "max_position_embeddings": 8192}
ALL = {"activation_checkpointing": True, "offload_activations": True, "fused_loss": True, "tiled_mlp": True,
       "tiled_layer": True}
NONE = {"activation_checkpointing": False, "fused_loss": False}
NO_OFFLOAD = {**ALL, "offload_activations": False}
CHUNKS = {**ALL, "attention_head_chunks": 8}
# Qwen3.5 / Qwen3-Next's layer shapes (hidden 2048; attention 16 q / 2 kv heads of 256; Gated DeltaNet 16 k / 32 v
# heads of 128), 2 layers (linear attention, then full attention), random weights
QWEN35_2L = {"num_heads": 16, "num_kv_heads": 2, "head_dim": 256, "hidden_size": 2048, "intermediate_size": 6144,
             "num_layers": 2, "vocab_size": 151936, "max_position_embeddings": 262144, "initializer_range": 0.02,
             "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128}
# runs that are not tiny:llama at SP 1: their model / sequence_parallel, and no memory meter (a threaded world's
# ranks share the device's allocator statistics)
EXTRA: dict[str, dict[str, Any]] = {
    "q35_sp1_16k": {"model": {"name": "tiny:qwen3_5", "kwargs": QWEN35_2L}},
    "q35_ring4_16k": {"model": {"name": "tiny:qwen3_5", "kwargs": QWEN35_2L},
                      "sequence_parallel": {"size": 4, "ulysses_degree": 1, "ring_degree": 4}},
}
RUNS: dict[str, tuple[dict, int, str, dict, str, int]] = {  # name: (model, length, precision, memory, optimizer, steps)
    "l2_none_16k": (LLAMA_2L, 16384, "bf16", NONE, "adamw", 3),
    "l2_all_16k": (LLAMA_2L, 16384, "bf16", ALL, "adamw", 3),
    "l2_all_64k": (LLAMA_2L, 65536, "bf16", ALL, "adamw", 3),
    "l2_nooffload_64k": (LLAMA_2L, 65536, "bf16", NO_OFFLOAD, "adamw", 3),
    "l2_all_128k": (LLAMA_2L, 131072, "bf16", ALL, "adamw", 3),
    "l2_all_256k": (LLAMA_2L, 262144, "bf16", ALL, "adamw", 3),
    "l2_nooffload_256k": (LLAMA_2L, 262144, "bf16", NO_OFFLOAD, "adamw", 3),
    "l2_chunks_64k": (LLAMA_2L, 65536, "bf16", {**ALL, "attention_head_chunks": 8}, "adamw", 3),
    "l2_chunks_256k": (LLAMA_2L, 262144, "bf16", {**ALL, "attention_head_chunks": 8}, "adamw", 3),
    "l2_keep_256k": (LLAMA_2L, 262144, "bf16", {**ALL, "attention_head_chunks": 8, "keep_attention": True}, "adamw",
                     3),
    "l2_fsdp_offload_64k": (LLAMA_2L, 65536, "bf16", ALL, "adamw", 3),
    # activation offload vs none vs FSDP2's CPU offload on top, at 64K with 8 head chunks (docs/gpu.md)
    "l2_chunks_nooffload_64k": (LLAMA_2L, 65536, "bf16", {**CHUNKS, "offload_activations": False}, "adamw", 3),
    "l2_chunks_fsdp_offload_64k": (LLAMA_2L, 65536, "bf16", CHUNKS, "adamw", 3),
    # a Qwen3.5-shaped 2-layer hybrid (Gated DeltaNet + attention), SP 1 and ring 4 on ONE GPU (threads): equal
    "q35_sp1_16k": (QWEN35_2L, 16384, "bf16", NONE, "sgd", 3),
    "q35_ring4_16k": (QWEN35_2L, 16384, "bf16", NONE, "sgd", 3),
    "tiny_fp32_none": (TINY, 2048, "fp32", NONE, "sgd", 3),
    "tiny_fp32_all": (TINY, 2048, "fp32", ALL, "sgd", 3),
}
# in order of what a short run must not miss (the JSON is rewritten after each run): about 6 minutes on an H200;
# `--runs all` adds the comparisons (no head chunks, no offload, 16K / 128K, FSDP2 CPU offload without chunks)
DEFAULT_RUNS = ["tiny_fp32_none", "tiny_fp32_all", "q35_sp1_16k", "q35_ring4_16k", "l2_chunks_64k", "l2_chunks_256k",
                "l2_keep_256k", "l2_chunks_nooffload_64k", "l2_chunks_fsdp_offload_64k"]
ALL_RUNS = DEFAULT_RUNS + ["l2_none_16k", "l2_all_64k", "l2_all_256k", "l2_all_128k", "l2_nooffload_256k", "l2_all_16k",
                           "l2_nooffload_64k", "l2_fsdp_offload_64k"]
QUICK_RUNS = ["tiny_fp32_none", "tiny_fp32_all"]


def _data(work: str, chars: int, rows: int = 6) -> str:
    path = os.path.join(work, f"text_{chars}.jsonl")
    if not os.path.exists(path):
        rnd = random.Random(0)
        words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9)))
                 for _ in range(500)]
        with open(path, "w") as fh:
            for _ in range(rows):
                out, n = [], 0
                while n < chars:
                    w = rnd.choice(words)
                    out.append(w)
                    n += len(w) + 1
                fh.write(json.dumps({"text": " ".join(out)}) + "\n")
    return path


def run_config(name: str, work: str) -> dict[str, Any]:
    model, length, prec, mem, opt, steps = RUNS[name]
    cfg = {
        "model": {"name": "tiny:llama", "kwargs": model},
        "dataset": {"path": _data(work, length + 64), "format": "text", "max_length": length, "shuffle": False},
        "precision": prec, "memory": dict(mem), "max_steps": steps, "micro_batch_size": 1, "grad_accum": 1,
        "optimizer": {"name": opt, "lr": 1.0e-3 if opt == "sgd" else 1.0e-5}, "sequence_parallel": {"size": 1},
        "fsdp": {"enabled": True, "offload": True} if "fsdp_offload" in name else False,
        "output_dir": os.path.join(work, "runs", name), "checkpoint": {"every": 0, "save_final": False},
        "export": {"final": False}, "progress": False, "overwrite_output_dir": True, "seed": 0,
    }
    cfg.update(EXTRA.get(name, {}))
    if cfg["sequence_parallel"]["size"] > 1:
        cfg["memory"]["measure"] = False
    return cfg


def model_flops(model: dict[str, Any], tokens: int) -> float:
    h, layers, d = model["hidden_size"], model["num_layers"], model["head_dim"]
    q, kv, i, v = model["num_heads"] * d, model["num_kv_heads"] * d, model["intermediate_size"], model["vocab_size"]
    n = layers * (h * q + 2 * h * kv + q * h + 3 * h * i) + h * v
    return 6.0 * n * tokens + 6.0 * layers * model["num_heads"] * d * tokens**2


def plan_row(name: str) -> dict[str, Any]:
    """What `seqpar plan` predicts for this run's configuration (peak bytes, tokens/s on one H200)."""
    from ..planner.gpus import make_cluster
    from ..planner.memory import Features, Layout, Workload, estimate_memory
    from ..planner.model import load_model_facts
    from ..planner.time import estimate_time

    model, length, prec, mem, _, _ = RUNS[name]
    m = load_model_facts("tiny:llama", model)
    wl = Workload(length, precision=prec, unsupervised_tokens=1)
    fsdp = "fsdp_offload" in name
    feats = Features(activation_checkpointing=mem.get("activation_checkpointing", False),
                     offload_activations=mem.get("offload_activations", False),
                     fused_loss=mem.get("fused_loss", True), tiled_mlp=mem.get("tiled_mlp", False),
                     tiled_layer=mem.get("tiled_layer", False), fsdp=fsdp, offload_optimizer=fsdp,
                     attention_head_chunks=mem.get("attention_head_chunks", 1),
                     keep_attention=mem.get("keep_attention", False))
    est = estimate_memory(m, wl, Layout(), feats)
    t = estimate_time(m, wl, Layout(), feats, make_cluster(1, gpu="h200"))
    return {"planned_peak_mib": est.total / 2**20, "planned_phase": est.phase,
            "planned_tokens_per_s": length / t.step_s}


def _launch(name: str, work: str, timeout: float, trace: bool) -> dict[str, Any]:
    os.makedirs(work, exist_ok=True)
    cfg_path = os.path.join(work, f"{name}.json")
    with open(cfg_path, "w") as fh:
        json.dump(run_config(name, work), fh)
    trace_path = os.path.join(work, f"{name}.trace.json")
    cmd = [sys.executable, "-m", "seqpar.bench.gpu_train", cfg_path] + ([trace_path] if trace else [])
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    mpath = os.path.join(work, "runs", name, "metrics.jsonl")
    rows = [json.loads(ln) for ln in open(mpath)] if os.path.exists(mpath) else []
    rec: dict[str, Any] = {"run": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "steps": rows}
    if rc != 0:
        rec["log_tail"] = log[-3000:]
    if trace and os.path.exists(trace_path):
        with open(trace_path) as fh:
            rec["peak_trace"] = json.load(fh)
    return rec


def _summarise(rec: dict[str, Any], peak_tflops: float) -> None:
    model, length, prec, mem, _, _ = RUNS[rec["run"]]
    steps = [r for r in rec["steps"] if "tokens_per_s" in r]
    if not steps:
        return
    later = steps[1:] or steps
    step_s = statistics.median(r["step_s"] for r in later)
    rec.update({"tokens": length, "step_s": step_s, "tokens_per_s": length / step_s,
                "peak_mib": max(r.get("peak_alloc_mb", r.get("peak_mem_mb", 0.0)) for r in steps),
                "offloaded_peak_mib": max(r.get("offloaded_peak_mb", 0.0) for r in steps),
                "host_state_mib": max(r.get("host_state_mb", 0.0) for r in steps)})
    if prec == "bf16" and rec["run"] not in EXTRA:
        rec["model_flops"] = model_flops(model, length)
        rec["mfu"] = rec["model_flops"] / step_s / (peak_tflops * 1e12)
        rec.update(plan_row(rec["run"]))
        rec["measured_over_planned_peak"] = rec["peak_mib"] / rec["planned_peak_mib"]


def _exactness(recs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    a, b = recs.get("tiny_fp32_none"), recs.get("tiny_fp32_all")
    if not a or not b or not a["steps"] or len(a["steps"]) != len(b["steps"]):
        return None
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)  # noqa: E731
    return {"loss_max_rel": max(rel(x["loss"], y["loss"]) for x, y in zip(b["steps"], a["steps"])),
            "grad_norm_max_rel": max(rel(x["grad_norm"], y["grad_norm"]) for x, y in zip(b["steps"], a["steps"])),
            "peak_mib_none": a.get("peak_mib"), "peak_mib_all": b.get("peak_mib"), "steps": len(a["steps"]),
            "optimizer": "sgd", "tolerance": 1e-5}


def train_part(runs: list[str] | None, work: str, timeout: float, peak_tflops: float, quick: bool,
               trace: str | None, save_partial=None) -> dict[str, Any]:
    names = ALL_RUNS if runs == ["all"] else runs or (QUICK_RUNS if quick else DEFAULT_RUNS)
    if trace and trace not in names:
        names = [*names, trace]
    recs: dict[str, dict[str, Any]] = {}
    part: dict[str, Any] = {}
    for name in names:
        rec = _launch(name, work, timeout, trace == name)
        _summarise(rec, peak_tflops)
        recs[name] = rec
        print(json.dumps({k: v for k, v in rec.items() if k not in ("steps", "log_tail", "peak_trace")}), flush=True)
        part = {"runs": list(recs.values()), "exactness": _exactness(recs), "mfu_definition": MFU_DEFINITION}
        q1, q4 = recs.get("q35_sp1_16k"), recs.get("q35_ring4_16k")
        if q1 and q4 and q1["steps"] and q4["steps"]:
            part["hybrid_ring4_vs_sp1"] = sp_agreement(q4["steps"], q1["steps"])
        if save_partial is not None:
            save_partial(part)
    return part


def train_lines(t: dict[str, Any]) -> list[str]:
    lines = []
    for r in t["runs"]:
        if "tokens_per_s" not in r:
            lines.append(f"  train {r['run']}: FAILED rc={r['rc']} {r.get('log_tail', '')[-300:]}")
            continue
        s = f"  train {r['run']}: {r['tokens_per_s']:.0f} tok/s, peak {r['peak_mib'] / 1024:.2f} GiB"
        if "mfu" in r:
            s += (f", MFU {100 * r['mfu']:.1f}%, plan {r['planned_peak_mib'] / 1024:.2f} GiB "
                  f"(measured/planned {r['measured_over_planned_peak']:.3f})")
        lines.append(s)
    ex = t.get("exactness")
    if ex:
        lines.append(f"  fp32 memory features vs none on CUDA: loss rel {ex['loss_max_rel']:.1e}, grad norm rel "
                     f"{ex['grad_norm_max_rel']:.1e} ({ex['steps']} SGD steps; peak {ex['peak_mib_all']:.0f} vs "
                     f"{ex['peak_mib_none']:.0f} MiB)")
    d = t.get("hybrid_ring4_vs_sp1")
    if d:
        lines.append(f"  Qwen3.5-shaped hybrid, ring 4 on one GPU vs SP 1 (bf16, SGD): loss rel "
                     f"{d['loss_max_rel']:.1e}, grad norm rel {d['grad_norm_max_rel']:.1e}")
    return lines


def sp_agreement(got: list[dict], want: list[dict]) -> dict[str, float]:
    """Per-step relative differences of loss and grad_norm (max over the steps) of two runs of the same rows."""
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)  # noqa: E731
    return {"loss_max_rel": max(rel(a["loss"], b["loss"]) for a, b in zip(got, want)),
            "grad_norm_max_rel": max(rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(got, want)),
            "steps": min(len(got), len(want))}


def peak_sites(snapshot: dict[str, Any], top: int = 40) -> dict[str, Any]:
    """Replay a torch.cuda.memory._snapshot() trace: the live allocations at the largest total, grouped by the
    innermost seqpar / transformers / torch frame that made them."""
    events = snapshot.get("device_traces", [[]])[0]
    live: dict[int, dict] = {}
    cur = peak = 0
    peak_i = -1
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, peak_i = cur, i
        elif ev["action"] in ("free_completed",) and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    live = {}
    for ev in events[: peak_i + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    sites: dict[str, list[int]] = {}
    for ev in live.values():
        key = _site(ev.get("frames", []))
        s = sites.setdefault(key, [0, 0])
        s[0] += ev["size"]
        s[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"traced_peak_mib": peak / 2**20, "events": len(events),
            "sites": [{"site": k, "mib": v[0] / 2**20, "count": v[1]} for k, v in ranked]}


def _site(frames: list[dict]) -> str:
    for marker in ("seqpar/", "transformers/", "torch/"):
        for f in frames:
            if marker in f.get("filename", ""):
                path = f["filename"].split(marker, 1)[1]
                return f"{marker}{path}:{f.get('line')} {f.get('name')}"
    return "unknown"


def _load(cfg_path: str):
    from ..train.config import config_from_dict

    with open(cfg_path) as fh:
        return config_from_dict(json.load(fh), source=cfg_path)


def _child(cfg_path: str, trace_path: str | None) -> None:
    import torch

    from ..train.run import train

    if trace_path:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    cfg = _load(cfg_path)
    if cfg.sequence_parallel.size > 1:  # SP > 1 on this one GPU: the ranks are threads (seqpar.threaded)
        from ..threaded import run_threaded

        run_threaded(lambda: train(_load(cfg_path)), cfg.sequence_parallel.size, device="cuda", timeout=900)
    else:
        train(cfg)
    if trace_path:
        with open(trace_path, "w") as fh:
            json.dump(peak_sites(torch.cuda.memory._snapshot()), fh, indent=1)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
