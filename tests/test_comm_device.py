"""One device rule for every collective (seqpar.comm), checked on CPU.

The bug this guards against: on CUDA the trainers start NCCL, then all-reduced CPU float64 metric
tensors (step stats, DPO metrics), which NCCL refuses: multi-GPU training died after step 1. On a
gloo CPU world that code runs fine, so a plain CPU test cannot see it. Strict mode
(SEQPAR_STRICT_COMM_DEVICE=1) makes every seqpar.comm collective refuse a call that does not name
the mesh's communication device, and every call refuses a tensor that is not on it; a static scan
(tests/test_static_layout.py) refuses raw torch.distributed collectives outside seqpar.comm. One spawned
2-rank world runs the CLI loop (DPO at dp=2, SFT and DPO under SP=2) and the HF Trainer drop-in's DPO log
path at dp=2 in strict mode.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import seqpar
from seqpar import SeqParError, comm
from seqpar.spawn import run_distributed


def test_check_device_rule(monkeypatch):
    x = torch.ones(2)
    comm.check_device([x], torch.device("cpu"), "t")  # on the comm device: fine
    with pytest.raises(SeqParError, match="on cpu .* communicates on meta"):
        comm.check_device([x], torch.device("meta"), "t")
    monkeypatch.delenv(comm.STRICT_DEVICE_ENV, raising=False)
    comm.check_device([x], None, "t")  # no device named: tolerated outside strict mode
    monkeypatch.setenv(comm.STRICT_DEVICE_ENV, "1")
    with pytest.raises(SeqParError, match="without device="):
        comm.check_device([x], None, "t")


def test_mesh_comm_device_follows_device_mesh():
    assert seqpar.init_mesh(1).comm_device == torch.device("cpu")
    fake = seqpar.SequenceParallelMesh(1, 1, 1, device_mesh=SimpleNamespace(device_type="meta"))
    assert fake.comm_device == torch.device("meta")


# ----------------------------------------------------------------------------- spawned, strict mode
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _write_data(d: Path) -> None:
    rng = random.Random(0)
    phrase = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    with open(d / "sft.jsonl", "w") as f:
        for _ in range(8):
            f.write(json.dumps({"instruction": phrase(1, 5), "response": phrase(2, 8)}) + "\n")
    with open(d / "dpo.jsonl", "w") as f:
        for _ in range(8):
            f.write(json.dumps({"prompt": phrase(1, 4), "chosen": phrase(1, 5), "rejected": phrase(2, 6)}) + "\n")


def _cli_case(d: str, name: str, stage: str, sp: dict) -> dict:
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": f"{d}/{stage}.jsonl", "max_length": 64},
        "stage": stage, "dpo": {"beta": 0.5}, "sequence_parallel": sp, "micro_batch_size": 2, "grad_accum": 1,
        "max_steps": 2, "optimizer": {"lr": 1e-2}, "output_dir": f"{d}/{name}", "progress": False, "seed": 0,
    }


def _hf_dpo_log_path(d: str) -> list[dict]:
    """SequenceParallelDPOTrainer at dp=2 (SP=1): its log() all-reduces the DPO metrics over dp."""
    import datasets
    from transformers import TrainingArguments

    from seqpar.hf import tiny_model
    from seqpar.hf.trainer import SequenceParallelDPOTrainer

    g = torch.Generator().manual_seed(0)
    pairs = [{k: torch.randint(3, 64, (n,), generator=g).tolist() for k, n in
              (("prompt_input_ids", 6), ("chosen_input_ids", 5), ("rejected_input_ids", 7))} for _ in range(8)]
    args = TrainingArguments(output_dir=f"{d}/hf_dpo", per_device_train_batch_size=2, max_steps=2,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, disable_tqdm=True)
    trainer = SequenceParallelDPOTrainer(model=tiny_model("llama", 4, 2, vocab_size=64, seed=1), args=args,
                                         train_dataset=datasets.Dataset.from_list(pairs), beta=0.5,
                                         sequence_parallel_size=1)
    assert trainer.sp_mesh.dp_size == 2
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def strict_world(d: str) -> dict:
    os.environ[comm.STRICT_DEVICE_ENV] = "1"
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    out: dict = {}
    mesh = seqpar.init_mesh(1)  # dp=2: the dp group is a real 2-rank group
    # Strict mode is live in this process: a call that does not name the device, or a tensor elsewhere, fails.
    out["no_device"] = _refused(lambda: comm.all_reduce_(torch.ones(1), mesh.dp_group))
    out["wrong_device"] = _refused(lambda: comm.all_reduce_(torch.ones(1), mesh.dp_group, device="meta"))
    cases = [("dpo_dp2", "dpo", {"size": 1}), ("sft_ring2", "sft", {"size": 2, "ring_degree": 2}),
             ("dpo_ulysses2", "dpo", {"size": 2, "ulysses_degree": 2})]
    for name, stage, sp in cases:
        res = train(config_from_dict(_cli_case(d, name, stage, sp)))
        rows = [json.loads(ln) for ln in Path(res.metrics_path).read_text().splitlines()] if res.metrics_path else []
        out[name] = {"losses": res.losses, "metric_keys": sorted(rows[-1]) if rows else []}
    out["hf_dpo"] = _hf_dpo_log_path(d)
    return out


def _refused(fn) -> str | None:
    try:
        fn()
    except SeqParError as e:
        return str(e)
    return None


def test_strict_comm_device_train_steps_and_hf_dpo_log(tmp_path):
    _write_data(tmp_path)
    results = run_distributed(strict_world, 2, str(tmp_path), timeout=600)
    for r in results:
        assert "without device=" in r["no_device"], r
        assert "communicates on meta" in r["wrong_device"], r
        for name in ("dpo_dp2", "sft_ring2", "dpo_ulysses2"):
            losses = r[name]["losses"]
            assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), (name, losses)
            assert losses == results[0][name]["losses"], name  # every rank logs the same reduced loss
        assert "rewards/accuracies" in results[0]["dpo_dp2"]["metric_keys"], results[0]["dpo_dp2"]
        hf = r["hf_dpo"]
        assert len(hf) == 2 and all("rewards/accuracies" in h for h in hf), hf
        assert hf == results[0]["hf_dpo"]  # dp-reduced metrics: identical on both ranks
