"""GRPO rollout seconds per step at SP = 1 / 2 / 4 on CPU: prompts shared over the SP group vs "rank 0 generates".

    python -m seqpar.bench rollout [--out bench_results/rollout.json] [--quick]

One rollout = one SP group's prompts x num_generations completions of max_new_tokens tokens (EOS never
sampled: every row decodes the full length, so the work is the same in every mode). Modes, per SP size:
- "shared": seqpar.hf.generation.generate_for_group (each SP rank samples its share of the prompts in one
  batched generate(), then an all-gather over the SP group);
- "rank0_batched": the group's first rank samples all rows in one batched generate(), then broadcasts;
- "rank0_per_prompt": the group's first rank samples prompt by prompt (the rows of one prompt batched), then
  broadcasts (seqpar before the shared rollout).
Each mode is timed `repeats` times after one warm-up (mode order rotated per round); per rank the fastest
time (least disturbed by other load), and of the ranks the slowest, is reported.
CPU timings on a shared machine are noisy, and SP ranks beyond the number of cores share cores (the JSON
records os.cpu_count()): a ratio there measures oversubscription, not the method.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

__all__ = ["run", "summary_lines"]

MODES = ("shared", "rank0_batched", "rank0_per_prompt")


def _model(quick: bool) -> torch.nn.Module:
    from ..hf import tiny_model

    if quick:
        return tiny_model("llama", 4, 2, vocab_size=259, seed=0).eval()
    return tiny_model("llama", 8, 4, vocab_size=4096, seed=0, hidden_size=512, intermediate_size=1376,
                      num_layers=6).eval()


def _rank0(model: torch.nn.Module, mesh: Any, prompts: list[list[int]], spec: dict, per_prompt: bool) -> list:
    from .. import comm
    from ..hf.generation import group_source_rank, row_seed, sample_rows, sampling_config

    cfg = sampling_config(max_new_tokens=spec["max_new_tokens"], eos_token_id=spec["eos"], pad_token_id=spec["pad"])
    g = spec["num_generations"]
    out: Any = None
    if mesh.sp_rank == 0:
        rows = [[list(p)] * g for p in prompts] if per_prompt else [[list(p) for p in prompts for _ in range(g)]]
        seeds = [row_seed(0, 0, 0, i, k) for i in range(len(prompts)) for k in range(g)]
        out, at = [], 0
        for chunk in rows:
            out += sample_rows(model, chunk, seeds[at:at + len(chunk)], cfg)
            at += len(chunk)
    if mesh.sp_size > 1:
        out = comm.broadcast_object(out, group_source_rank(mesh), mesh.comm_device, group=mesh.sp_group)
    return out


def _world(quick: bool, spec: dict, repeats: int) -> dict:
    """On every rank of an SP=world group: seconds per rollout for each mode (this rank's wall times)."""
    import torch.distributed as dist

    from .. import init_mesh
    from ..hf.generation import generate_for_group

    mesh = init_mesh(dist.get_world_size())
    model = _model(quick)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (int(n),), generator=g).tolist()
               for n in torch.randint(spec["prompt_len"] // 2, spec["prompt_len"] + 1, (spec["prompts"],), generator=g)]

    def shared() -> list:
        return generate_for_group(model, mesh, prompts, num_generations=spec["num_generations"],
                                  max_new_tokens=spec["max_new_tokens"], eos_token_id=spec["eos"],
                                  pad_token_id=spec["pad"])

    fns = {"shared": shared, "rank0_batched": lambda: _rank0(model, mesh, prompts, spec, False),
           "rank0_per_prompt": lambda: _rank0(model, mesh, prompts, spec, True)}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    outputs = {}
    for i in range(repeats + 1):
        for mode in MODES[i % 3:] + MODES[:i % 3]:  # rotated: no mode always runs first after a round
            dist.barrier()
            t0 = time.perf_counter()
            outputs[mode] = fns[mode]()
            dist.barrier()
            if i:  # the first round warms up
                times[mode].append(time.perf_counter() - t0)
    same = outputs["shared"] == outputs["rank0_batched"]
    return {"seconds": {m: min(t) for m, t in times.items()}, "same_completions": same,
            "rows": len(outputs["shared"])}


def run(quick: bool = False, sp_sizes: tuple[int, ...] = (1, 2, 4), repeats: int = 3,
        timeout: float = 1800.0) -> dict:
    """The benchmark (module docstring); a JSON-able dict."""
    from ..spawn import run_distributed

    spec = ({"prompts": 4, "num_generations": 2, "max_new_tokens": 8, "prompt_len": 16} if quick else
            {"prompts": 8, "num_generations": 4, "max_new_tokens": 32, "prompt_len": 64})
    spec.update(eos=10**6, pad=258)  # an EOS id outside the vocabulary: never drawn
    results = []
    for sp in sp_sizes:
        per_rank = run_distributed(_world, sp, quick, spec, 1 if quick else repeats, timeout=timeout)
        secs = {m: max(r["seconds"][m] for r in per_rank) for m in MODES}
        results.append({"sp": sp, "seconds_per_rollout": secs, "same_completions": per_rank[0]["same_completions"],
                        "rows": per_rank[0]["rows"],
                        "speedup_vs_rank0_batched": secs["rank0_batched"] / secs["shared"],
                        "speedup_vs_rank0_per_prompt": secs["rank0_per_prompt"] / secs["shared"]})
    return {"bench": "rollout", "quick": quick, "spec": spec, "cpu_count": os.cpu_count(),
            "torch_threads_per_rank": 1, "results": results}


def summary_lines(result: dict) -> list[str]:
    lines = [f"rollout: {result['spec']} ({result['cpu_count']} CPUs, 1 thread per rank)"]
    for r in result["results"]:
        s = r["seconds_per_rollout"]
        lines.append(f"SP={r['sp']}: shared {s['shared']:.2f}s, rank 0 batched {s['rank0_batched']:.2f}s "
                     f"(x{r['speedup_vs_rank0_batched']:.2f}), rank 0 per prompt {s['rank0_per_prompt']:.2f}s "
                     f"(x{r['speedup_vs_rank0_per_prompt']:.2f}); same completions: {r['same_completions']}")
    return lines
