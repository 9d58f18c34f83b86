"""The TRL drop-ins at dp 2 x sp 2 against stock TRL on one process, in ONE spawned 4-rank world.

The fast twins of the dp 2 x sp 2 cases that otherwise run only in slow tests, each against the same reference
and with the same checks as its slow twin:
- SFT (tests/test_trl.py, SLOW "sft dp=2 x sp=2"): per-step gradient norms before clipping (1e-5 relative),
  losses and the final parameters (1e-5) after 3 SGD steps, vs stock trl.SFTTrainer with the rows of both dp
  ranks in its batch;
- GRPO (tests/test_trl_grpo.py, SLOW_CASES): gradient norms, losses and parameters after 2 SGD steps (1e-5);
- TRL's logged metrics (tests/test_trl_metrics.py, SLOW's dp 2 x sp 2 rows): SFT on conversational rows, DPO
  with the IPO loss (its rewards of the summed log-probs), every training row and the eval row, 1e-5 relative.
The stock references run in the test process first.
"""

from __future__ import annotations

import test_trl
import test_trl_grpo
import test_trl_metrics
import torch

from seqpar.spawn import run_distributed

SFT = [{"name": "sft dp=2 x sp=2", "stage": "sft", "arch": "llama", "data": "prompt_completion", "dp": 2}]
GRPO = test_trl_grpo.SLOW_CASES
METRICS = [case for case in test_trl_metrics.SLOW if case.get("dp") == 2]


def _world(sft_refs: str, model_dir: str, grpo_refs: str, out: str) -> dict:
    return {"sft": test_trl._sp_world(SFT, sft_refs, f"{out}/sft"),
            "grpo": test_trl_grpo._sp_world(GRPO, model_dir, grpo_refs, f"{out}/grpo"),
            "metrics": test_trl_metrics._sp_world(METRICS, f"{out}/metrics")}


def test_trl_sft_grpo_and_metrics_dp2_sp2_match_stock_trl(tmp_path):
    assert len(GRPO) == 1 and GRPO[0]["dp"] == 2 and len(METRICS) == 2
    torch.save([test_trl._train(c, str(tmp_path / f"sft_ref{i}"), None) for i, c in enumerate(SFT)],
               tmp_path / "sft_refs.pt")
    model_dir, grpo_refs = test_trl_grpo._references(GRPO, tmp_path / "grpo")
    metric_refs = [test_trl_metrics._train(c, str(tmp_path / f"metrics_ref{i}"), None) for i, c in enumerate(METRICS)]
    results = run_distributed(_world, 4, str(tmp_path / "sft_refs.pt"), model_dir, grpo_refs, str(tmp_path / "sp"),
                              timeout=540)
    test_trl._check([r["sft"] for r in results])
    test_trl_grpo._check([r["grpo"] for r in results])
    test_trl_metrics._check_all([r["metrics"] for r in results], METRICS, metric_refs)
