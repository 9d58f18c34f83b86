"""Shared data and configs of the length-aware SP tests (tests/test_dynamic_train.py, test_dynamic_more.py):
long-tailed tokenized SFT rows, DPO pairs, GRPO prompts; a fixed / dynamic config pair per case; the rank body
that trains a list of cases and returns every metrics row."""

from __future__ import annotations

import json
import random
from pathlib import Path

TINY = {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}}
# 4 ranks, max_length 128 and N = 32: rows <= 32 tokens run at degree 1, <= 64 at 2 (ulysses 2), the rest at 4
# (ulysses 2 x ring 2, zigzag: 128 / 4 = 32 per rank); the fixed run is size 4 (what 128 tokens need at N = 32).
DYNAMIC = {"size": "dynamic", "max_local_tokens": 32}
FIXED = {"size": 4}
SGD = {"name": "sgd", "lr": 0.5}


# Four rows a step (the fixed run: size 4, grad_accum 4): 17 rows of <= 32 tokens, 5 of 33-64, 2 of 65-128; step 1
# holds all three degrees, step 3 only degree 1.
SFT_LENGTHS = [100, 20, 50, 12, 10, 25, 18, 60, 8, 30, 14, 22, 120, 40, 9, 28, 16, 11, 70, 26, 31, 19, 7, 24]


def write_sft(path: Path, seed: int = 0, lengths: list[int] | None = None) -> Path:
    """Tokenized rows of SFT_LENGTHS (or `lengths`) tokens (random ids; the first 3 positions unsupervised)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for length in lengths or SFT_LENGTHS:
            ids = [rng.randint(3, 250) for _ in range(length)]
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * 3 + ids[3:]}) + "\n")
    return path


def write_dpo(path: Path, n: int = 16, seed: int = 1) -> Path:
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    def phrase(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    with open(path, "w") as f:
        for _ in range(n):
            x = rng.random()
            k = 1 if x < 0.7 else 3 if x < 0.9 else 8
            f.write(json.dumps({"prompt": phrase(k), "chosen": phrase(rng.randint(1, k)),
                                "rejected": phrase(rng.randint(1, k + 1))}) + "\n")
    return path


GRPO_PROMPTS = ["alpha beta", "gamma", "delta epsilon zeta eta", "eta", "theta iota", "kappa lambda mu nu xi", "o",
                "pi rho"]


def write_grpo(path: Path) -> Path:
    with open(path, "w") as f:
        for p in GRPO_PROMPTS:
            f.write(json.dumps({"prompt": p, "answer": "a"}) + "\n")
    return path


def sft_case(data: Path, out: Path, sp: dict, *, fsdp: bool = False, steps: int = 3, measure: bool = False,
             model: dict | None = None, lora: bool = False) -> dict:
    c = {"model": model or TINY, "dataset": {"path": str(data), "format": "tokenized", "max_length": 128,
                                             "shuffle": False},
         "sequence_parallel": sp, "fsdp": fsdp, "micro_batch_size": 1, "grad_accum": 4, "max_steps": steps,
         "optimizer": SGD, "output_dir": str(out), "progress": False, "seed": 0, "memory": {"measure": measure},
         "checkpoint": {"save_final": True}, "export": {"final": False}}
    if lora:
        c["finetuning"] = {"method": "lora", "r": 4, "alpha": 8}
    return c


def dpo_case(data: Path, out: Path, sp: dict) -> dict:
    c = sft_case(data, out, sp)
    c.update(stage="dpo", dataset={"path": str(data), "max_length": 128, "shuffle": False}, dpo={"beta": 0.5})
    return c


def grpo_case(data: Path, out: Path, sp: dict, *, fsdp: bool = False) -> dict:
    c = sft_case(data, out, sp, steps=2, fsdp=fsdp)
    c.update(stage="grpo", dataset={"path": str(data), "max_length": 48}, micro_batch_size=2, grad_accum=2, seed=9,
             grpo={"reward_funcs": ["seqpar:length", "seqpar:contains"], "reward_weights": [1.0, 0.5],
                   "num_generations": 2, "max_prompt_length": 24, "max_completion_length": 12, "temperature": 0.7,
                   "beta": 0.04})
    return c


def train_cases(cases: list[tuple]) -> dict[str, list[dict]]:
    """Rank body: train each (name, config[, env]) case; every metrics row of each (read back from metrics.jsonl).
    env: variables set for that case only (test-only fault hooks, seqpar.train.loop.grads)."""
    import os
    from unittest import mock

    from seqpar.train.config import config_from_dict
    from seqpar.train.loop.plots import read_metrics
    from seqpar.train.run import train

    out = {}
    for name, c, *env in cases:
        with mock.patch.dict(os.environ, env[0] if env else {}):
            res = train(config_from_dict(c))
        out[name] = read_metrics(Path(res.metrics_path))
    return out


def compare(fixed: list[dict], dyn: list[dict], tol: float = 1e-5) -> tuple[float, float]:
    """Max |dloss| and max |dgrad_norm| (relative above 1) over the steps; both lists have every step."""
    assert len(fixed) == len(dyn) and fixed, (len(fixed), len(dyn))
    dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(fixed, dyn))
    dgn = max(abs(a["grad_norm"] - b["grad_norm"]) / max(1.0, abs(a["grad_norm"])) for a, b in zip(fixed, dyn))
    assert dloss <= tol and dgn <= tol, (dloss, dgn, [(a["loss"], b["loss"]) for a, b in zip(fixed, dyn)])
    return dloss, dgn


def write_vlm(folder: Path, n: int = 12, seed: int = 0) -> Path:
    """Chat rows with 0-2 images of different sizes and answers of 2-30 words (rows of ~20-120 tokens)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "imgs").mkdir(parents=True, exist_ok=True)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    rows = []
    for i in range(n):
        k = int(rng.integers(0, 3))
        images = []
        for j in range(k):
            h, w = [(16, 24), (24, 16), (16, 16), (32, 24)][(i + j) % 4]
            Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(folder / "imgs" / f"{i}_{j}.png")
            images.append(f"imgs/{i}_{j}.png")
        answer = int(rng.choice([2, 3, 4, 12, 30], p=[0.3, 0.3, 0.2, 0.1, 0.1]))
        user = " ".join(["<image>"] * k + list(rng.choice(words, 2)))
        row = {"messages": [{"role": "user", "content": user},
                            {"role": "assistant", "content": " ".join(rng.choice(words, answer))}]}
        if images:
            row["images"] = images
        rows.append(row)
    path = folder / "vlm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
