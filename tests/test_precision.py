"""`precision: bf16` is mixed precision (bf16 compute, fp32 master weights), `bf16-pure` is not.

One process, SP=1, tiny Llama, AdamW with lr 1e-5: each step moves a weight by about 1e-5, far
below half a bf16 ulp of most weights (e.g. 6e-5 at |w| = 0.02), so pure bf16 weights do not move
while the fp32 masters of mixed precision do -- the difference is the test. Checkpoints hold the
fp32 masters: a resumed bf16 run ends bit-identical to the uninterrupted one.
"""

from __future__ import annotations

import json

import pytest
import torch

STEPS = 3
LR = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    with open(d / "sft.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"instruction": f"say {i} " * (1 + i % 3), "response": "ok " * (2 + i)}) + "\n")
    return d / "sft.jsonl"


def _cfg(data, out, precision, **over):
    from seqpar.train.config import config_from_dict

    c = {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 2, "num_kv_heads": 1, "num_layers": 2}},
        "dataset": {"path": str(data), "max_length": 64},
        "precision": precision,
        "micro_batch_size": 2,
        "max_steps": STEPS,
        "optimizer": {"name": "adamw", "lr": LR},
        "checkpoint": {"save_final": True},
        "output_dir": str(out),
        "progress": False,
    }
    c.update(over)
    return config_from_dict(c)


def _initial(cfg):
    from seqpar.train.model.load import load_model

    torch.manual_seed(cfg.seed)
    return {k: v.detach().clone() for k, v in load_model(cfg).named_parameters()}


def _final(cfg):
    from seqpar.train.run import train

    res = train(cfg)
    return torch.load(res.final_state_path), res.losses


def test_bf16_master_weights_move_where_pure_bf16_does_not(data, tmp_path):
    mixed_cfg = _cfg(data, tmp_path / "mixed", "bf16")
    init = _initial(mixed_cfg)
    mixed, mixed_losses = _final(mixed_cfg)
    pure, pure_losses = _final(_cfg(data, tmp_path / "pure", "bf16-pure"))
    n = sum(v.numel() for v in init.values())
    # Mixed: the final state is the fp32 masters, and nearly every element moved by ~STEPS * lr.
    assert all(mixed[k].dtype == torch.float32 for k in init)
    moved_mixed = sum(int(((mixed[k] - init[k]).abs() > LR / 10).sum()) for k in init) / n
    max_mixed = max(float((mixed[k] - init[k]).abs().max()) for k in init)
    # Pure: bf16 weights; an update of 1e-5 rounds away for almost every element.
    assert all(pure[k].dtype == torch.bfloat16 for k in init)
    moved_pure = sum(int((pure[k] != init[k].to(torch.bfloat16)).sum()) for k in init) / n
    print(f"fraction of weights moved: mixed {moved_mixed:.3f} (max {max_mixed:.2e}), pure {moved_pure:.3f}")
    # (embedding rows of bytes absent from the data get no gradient and stay put in both runs)
    assert moved_mixed > 0.5 and max_mixed < 2 * STEPS * LR, (moved_mixed, max_mixed)  # masters start at fp32 init
    assert moved_pure < 0.1, moved_pure
    assert len(mixed_losses) == len(pure_losses) == STEPS


def test_bf16_resume_restores_fp32_masters(data, tmp_path):
    """Checkpoint at step 2 of 3, resume: the final fp32 masters equal the uninterrupted run's exactly
    (restoring the masters from the bf16 weights instead would lose their sub-ulp progress)."""
    from seqpar.train.run import train

    full, _ = _final(_cfg(data, tmp_path / "full", "bf16"))
    part = _cfg(data, tmp_path / "part", "bf16", max_steps=2, checkpoint={"every": 1, "save_final": False})
    train(part)  # checkpoint-2: the last step is checkpointed too
    resumed_cfg = _cfg(data, tmp_path / "part", "bf16", checkpoint={"every": 1, "save_final": True})
    res = train(resumed_cfg)
    assert res.resumed_from == 2 and res.steps == [3]
    resumed = torch.load(res.final_state_path)
    assert resumed.keys() == full.keys() and len(full) > 0
    for k in full:
        assert resumed[k].dtype == torch.float32 and torch.equal(resumed[k], full[k]), k
