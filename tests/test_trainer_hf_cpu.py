"""The HF Trainer drop-in on CPU ranks without `use_cpu=True` (2 gloo ranks, SP=2).

accelerate sets up multi-CPU DDP only with use_cpu=True; without it, on a machine with no accelerator it
sets up no distributed training and never wraps the model in DDP. SequenceParallelTrainer switches
use_cpu on when there are several ranks and no accelerator (also after args.device was read), so a
plain TrainingArguments trains, and bit for bit like the explicit use_cpu=True run.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.spawn import run_distributed


def _train_both(out: str) -> dict:
    import datasets
    from transformers import TrainingArguments

    from seqpar.hf import tiny_model
    from seqpar.hf.trainer import SequenceParallelTrainer

    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_list([{"input_ids": torch.randint(3, 64, (int(n),), generator=g).tolist()}
                                     for n in torch.randint(20, 40, (8,), generator=g)])
    res = {}
    for name, extra in (("default", {}), ("use_cpu", {"use_cpu": True})):
        args = TrainingArguments(output_dir=f"{out}/{name}", per_device_train_batch_size=2, max_steps=3,
                                 learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                 train_sampling_strategy="sequential", disable_tqdm=True, seed=0, **extra)
        _ = args.device  # read before the Trainer exists: the trainer must still fix the setup
        t = SequenceParallelTrainer(model=tiny_model("llama", 4, 2, vocab_size=64, seed=0), args=args,
                                    train_dataset=ds)
        t.train()
        res[name] = {"losses": [h["loss"] for h in t.state.log_history if "loss" in h],
                     "dist": t.accelerator.distributed_type.name, "use_cpu": args.use_cpu}
    return res


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only setup: this machine has CUDA")
def test_trainer_on_cpu_without_use_cpu(tmp_path):
    r0, r1 = run_distributed(_train_both, 2, str(tmp_path), timeout=600)
    assert r0 == r1
    assert r0["default"]["dist"] == "MULTI_CPU" and r0["default"]["use_cpu"] is True
    assert len(r0["default"]["losses"]) == 3
    assert r0["default"]["losses"] == r0["use_cpu"]["losses"]
