"""`python -m seqpar.bench rollout --engines --quick` (transformers vs vLLM rollouts through `seqpar train`): the
JSON's structure, the PNG, and both engines decoding the same number of tokens (every row the full length: the
benchmark removes the stop token). One rank (SP 1) to stay cheap: the engine's start is most of its time."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")


@pytest.mark.slow  # about a minute, mostly vLLM's start: make test-all
def test_quick_engines_benchmark(tmp_path):
    from seqpar.bench.__main__ import main
    from seqpar.bench.rollout_engines import ENGINES

    out = tmp_path / "engines.json"
    assert main(["rollout", "--engines", "--quick", "--sp", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (tmp_path / "engines.png").stat().st_size > 0
    assert res["bench"] == "rollout_engines" and res["quick"] and res["sp"] == 1
    for key in ("cpu_count", "torch_threads_per_rank", "loadavg_start", "loadavg_end", "versions", "spec", "warmup"):
        assert key in res, key
    assert {"torch", "transformers", "vllm"} <= set(res["versions"])
    s = res["spec"]
    rows_tokens = s["prompts"] * s["num_generations"] * s["max_new_tokens"]
    assert [(r["model"], r["engine"]) for r in res["runs"]] == [("tiny", e) for e in ENGINES]
    for r in res["runs"]:
        assert r["steps"] and all(st["completion_tokens"] == rows_tokens for st in r["steps"]), r
        assert all(st["step_wall_s"] > 0 and st["engine_s"] > 0 and st["train_s"] > 0 for st in r["steps"]), r
        assert all(st["engine_cpu_s"] > 0 and st["train_cpu_s"] > 0 for st in r["steps"]), r
    per = res["results"]["tiny"]
    assert per["same_completion_tokens"]
    assert per["transformers"]["completion_tokens_per_step"] == per["vllm"]["completion_tokens_per_step"] == rows_tokens
    for e in ENGINES:
        assert per[e]["rollout_tokens_per_s"] > 0 and per[e]["steps_per_s"] > 0
    assert per["vllm"]["best_step"]["push_s"] > 0 and per["transformers"]["best_step"]["push_s"] == 0
    ratio = per["vllm_over_transformers"]
    assert ratio["rollout_tokens_per_s"] == pytest.approx(
        per["vllm"]["rollout_tokens_per_s"] / per["transformers"]["rollout_tokens_per_s"])
