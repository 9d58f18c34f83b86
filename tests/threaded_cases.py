"""Worlds of ranks as threads of one process (seqpar.threaded), shared by the CPU suite and `make test-gpu`.

`train_rows` runs `seqpar.train.run.train` on every rank of a threaded world (on the CPU or one CUDA device) and
returns the run's metrics rows; `compare_rows` holds two runs' per-step loss and gradient norm to a tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

from seqpar.threaded import run_threaded

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny_usp.yaml"
MODELS = {  # Llama-shaped (GQA) and Qwen3.5-shaped (Gated DeltaNet + attention, 4 k heads) tiny decoders
    "llama": {"name": "tiny:llama", "kwargs": {"num_heads": 8, "num_kv_heads": 4, "num_layers": 2}},
    # (k / v head dims 16: flash-linear-attention's Triton kernels, where installed, take no smaller tiles)
    "qwen3_5": {"name": "tiny:qwen3_5", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2,
                                                   "linear_key_head_dim": 16, "linear_value_head_dim": 16}},
}


def _train(out: str, model: str | dict, sp: int, u: int, r: int, steps: int, precision: str, kernel: str,
           checkpoint_every: int, extra: dict | None = None) -> None:
    from seqpar.train.config.load import load_config
    from seqpar.train.run import train

    cfg = load_config(EXAMPLE, {
        "model": MODELS[model] if isinstance(model, str) else model,
        "sequence_parallel": {"size": sp, "ulysses_degree": u, "ring_degree": r},
        "output_dir": out, "max_steps": steps, "optimizer": {"name": "sgd", "lr": 0.1}, "precision": precision,
        "attention_kernel": kernel, "checkpoint": {"every": checkpoint_every, "save_final": False},
        "export": {"final": False}, "progress": False,
        # the CPU meter's module hooks and CUDA's peak statistics are process-wide: off in a threaded world
        "memory": {"measure": False}, **(extra or {})})
    train(cfg)


def train_rows(out: Path, model: str | dict, u: int, r: int, *, steps: int = 3, precision: str = "fp32",
               kernel: str = "auto", device: str = "cpu", checkpoint_every: int = 2,
               extra: dict | None = None) -> list[dict]:
    """The metrics rows of a `seqpar train` run at ulysses u x ring r, its ranks threads of this process (`model`: a
    MODELS key or a config's `model` section; `extra`: more config sections, replacing the example's)."""
    sp = u * r
    run_threaded(_train, sp, str(out), model, sp, u, r, steps, precision, kernel, checkpoint_every, extra,
                 device=device, timeout=600)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def compare_rows(got: list[dict], want: list[dict], rel: float) -> list[tuple[float, float]]:
    """Per step, the relative differences of loss and grad_norm; asserts them within `rel`."""
    assert len(got) == len(want) > 0
    diffs = [(abs(g["loss"] - w["loss"]) / abs(w["loss"]), abs(g["grad_norm"] - w["grad_norm"]) / w["grad_norm"])
             for g, w in zip(got, want)]
    assert all(max(d) <= rel for d in diffs), diffs
    return diffs
