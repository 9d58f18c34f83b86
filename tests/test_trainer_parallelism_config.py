"""accelerate's ParallelismConfig in TrainingArguments becomes seqpar's mesh.

The HF "Ulysses SP" recipe sets `TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed",
sp_size=..., dp_shard_size=...), deepspeed=<ZeRO-3 config>)`. With only the trainer class swapped to
`SequenceParallelTrainer` (no sequence_parallel_size given), the run must use seqpar's SP over sp_size ranks
(DeepSpeed's own Ulysses and torch context parallelism must not run underneath) and train exactly like the stock
Trainer on one process: every step's gradient norm at 1e-5 relative, every loss and the final parameters at 1e-5.
"""

from __future__ import annotations

import json
import sys

import pytest
from procs import FULL_PARAMS_SCRIPT, SFT_ROWS_SCRIPT, check_params, run_script

SCRIPT = r'''
import json, sys
import torch, datasets
from accelerate import ParallelismConfig
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from seqpar.hf.trainer import SequenceParallelTrainer

mode, out, model_dir, sp, dp_shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
''' + SFT_ROWS_SCRIPT + FULL_PARAMS_SCRIPT + r'''
kw = {}
if mode == "sp":  # the ALST recipe: ZeRO-3 + parallelism_config(sp_backend="deepspeed", sp_size, dp_shard_size)
    kw["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, dp_shard_size=dp_shard)
    kw["deepspeed"] = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                       "train_micro_batch_size_per_gpu": 2 if dp_shard == 1 else 1,
                       "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
bs = 2 if mode == "plain" or dp_shard == 1 else 1  # dp_shard 2 x batch 1 = the plain run's batch 2
args = TrainingArguments(output_dir=f"{out}/run", per_device_train_batch_size=bs, gradient_accumulation_steps=2,
                         max_steps=4, logging_steps=1, report_to=[], save_strategy="no",
                         train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True,
                         optim="sgd", learning_rate=0.1, max_grad_norm=1.0, **kw)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
if mode == "sp":
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=ds)   # <- the only change
else:
    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=pad_collate)
if mode == "plain":
    torch.save(full_params(model), f"{out}/init_params.pt")
trainer.train()
params = full_params(trainer.model)  # every rank: a collective under ZeRO-3
if trainer.is_world_process_zero():
    torch.save(params, f"{out}/params.pt")
res = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
       "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}
if mode == "sp":
    m = trainer.sp_mesh
    res.update(mesh=[m.dp_size, m.sp_size], wrapped=type(trainer.model_wrapped).__name__,
               pc=trainer.accelerator.parallelism_config is not None)
if trainer.is_world_process_zero():
    json.dump(res, open(f"{out}/result.json", "w"))
'''


def _run(tmp_path, mode: str, nproc: int, sp: int, dp_shard: int) -> dict:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    if not (tmp_path / "model").exists():
        from seqpar.hf import tiny_model

        tiny_model("llama", 3, 1, vocab_size=64, seed=0).save_pretrained(tmp_path / "model")
    out = tmp_path / mode
    out.mkdir()
    cmd = [str(script), mode, str(out), str(tmp_path / "model"), str(sp), str(dp_shard)]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd]
    run_script([sys.executable, *cmd], tmp_path, result=out / "result.json", timeout=280)
    return {**json.loads((out / "result.json").read_text()), "dir": str(out)}


def _check(tmp_path, nproc: int, sp: int, dp_shard: int) -> None:
    ref = _run(tmp_path, "plain", 1, 1, 1)
    got = _run(tmp_path, "sp", nproc, sp, dp_shard)
    assert got["mesh"] == [dp_shard, sp] and got["wrapped"] == "DeepSpeedEngine" and not got["pc"], got
    assert len(got["grad_norms"]) == len(ref["grad_norms"]) == 4, (got, ref)
    assert max(abs(a - b) / b for a, b in zip(got["grad_norms"], ref["grad_norms"])) <= 1e-5, (got, ref)
    assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-5, (got, ref)
    check_params(got["dir"], ref["dir"])


@pytest.mark.slow
def test_parallelism_config_sp2_becomes_the_seqpar_mesh(tmp_path):
    _check(tmp_path, 2, 2, 1)


@pytest.mark.slow
def test_alst_blog_config_zero3_sp2_x_dp_shard2(tmp_path):
    """The HF blog's 4-GPU ALST layout: ZeRO-3, sp 2 x dp_shard 2 (batch 1 per dp rank = the plain run's 2)."""
    _check(tmp_path, 4, 2, 2)
