"""The README's custom-model example runs on 4 ranks and matches the single-process layer (fp32, 2e-5); the GRPO
example learns (slow)."""

import importlib.util
import json
import os
import pathlib
import sys

import pytest
from procs import run_command

from seqpar.spawn import run_distributed

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_attention.py"


def _run_example():
    spec = importlib.util.spec_from_file_location("custom_attention", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main()


def test_custom_attention_example():
    errs = run_distributed(_run_example, 4, timeout=180)
    assert max(errs) < 2e-5, errs


@pytest.mark.slow
def test_grpo_tiny_example_learns(tmp_path):
    """examples/grpo_tiny.yaml as documented (2 ranks, SP=2, its reward module found next to the config, run
    from another folder): the reward rises over its 30 steps (measured ~0.09 -> ~0.85, docs/grpo.md)."""
    cfg = EXAMPLE.parent / "grpo_tiny.yaml"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-c", "import sys; from seqpar.cli.main import main; sys.exit(main(sys.argv[1:]))",
           "train", str(cfg), "--nproc-per-node", "2", "--output-dir", str(tmp_path / "run"), "--set", "progress=false"]
    p = run_command(cmd, cwd=tmp_path, env=env, timeout=540)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"grpo_tiny reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}: {[round(x, 2) for x in rewards]}")
    assert first < 0.2 and last > first + 0.3, rewards
    assert all(r["reward_std"] > 0 for r in rows[:5])  # a learning signal from the first step (not all clipped)
