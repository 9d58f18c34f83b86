"""An HF Trainer script gains SP by changing the class.

The same script runs (a) with `transformers.Trainer` in one process and (b) with
`SequenceParallelTrainer` under torchrun on 2 ranks (tiny Llama with 3 q / 1 kv heads, so the
auto mesh is a zigzag ring of 2). Per-step logged training losses must agree within 1e-5 (fp32,
grad accumulation 2, lr 1e-2), and the SP `evaluate()` must equal an independent one-process
global token-mean CE of the plain run's final model within 1e-5. The script then runs
`SequenceParallelDPOTrainer` at SP=2 and at SP=1 (one process): losses within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, sys
import torch, datasets
from transformers import Trainer, TrainingArguments
from seqpar.hf import tiny_model
from seqpar.hf.trainer import SequenceParallelDPOTrainer, SequenceParallelTrainer

mode, out = sys.argv[1], sys.argv[2]
ga = int(sys.argv[3]) if len(sys.argv) > 3 else 2
sp_kw = {"sequence_parallel_size": int(sys.argv[4]), "packing": True} if len(sys.argv) > 4 else {}
g = torch.Generator().manual_seed(0)
rows, pairs = [], []
for i in range(16):
    n = int(torch.randint(20, 60, (1,), generator=g))
    ids = torch.randint(3, 64, (n,), generator=g).tolist()
    rows.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
    p, c, r = (torch.randint(3, 64, (int(torch.randint(4, k, (1,), generator=g)),), generator=g).tolist()
               for k in (20, 30, 30))
    pairs.append({"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r})
ds = datasets.Dataset.from_list(rows)

def pad_collate(batch):
    m = max(len(r["input_ids"]) for r in batch)
    ids = torch.tensor([r["input_ids"] + [0] * (m - len(r["input_ids"])) for r in batch])
    lab = torch.tensor([r["labels"] + [-100] * (m - len(r["labels"])) for r in batch])
    att = torch.tensor([[1] * len(r["input_ids"]) + [0] * (m - len(r["input_ids"])) for r in batch])
    return {"input_ids": ids, "labels": lab, "attention_mask": att}

def args(sub):
    return TrainingArguments(output_dir=f"{out}/{sub}", per_device_train_batch_size=2, gradient_accumulation_steps=ga,
                             max_steps=4, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                             train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True)

model = tiny_model("llama", 3, 1, vocab_size=64, seed=0)
Cls = SequenceParallelTrainer if mode == "sp" else Trainer          # <- the only change
trainer = Cls(model=model, args=args("sft"), train_dataset=ds, eval_dataset=ds, data_collator=pad_collate,
              **(sp_kw if mode == "sp" else {}))
trainer.train()
res = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
if mode == "sp":
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    res["mesh"] = [trainer.sp_mesh.sp_size, trainer.sp_mesh.ring_degree, trainer.sp_mesh.ulysses_degree]
else:  # independent reference for the SP eval: global token-mean CE of the final model
    model.eval()
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for r in rows:
            logits = model(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1]
            lab = torch.tensor(r["labels"][1:])
            tot += float(torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum"))
            cnt += int((lab != -100).sum())
    res["ref_eval_loss"] = tot / cnt
if sp_kw:  # the dp x sp variant checks SFT only
    json.dump(res, open(f"{out}/result.json", "w")) if trainer.is_world_process_zero() else None
    sys.exit(0)
dpo = SequenceParallelDPOTrainer(model=tiny_model("llama", 3, 1, vocab_size=64, seed=1), args=args("dpo"),
                                 train_dataset=datasets.Dataset.from_list(pairs), beta=0.5)
dpo.train()
res["dpo_losses"] = [h["loss"] for h in dpo.state.log_history if "loss" in h]
res["dpo_metrics"] = sorted(k for h in dpo.state.log_history for k in h if k.startswith("rewards/"))
if trainer.is_world_process_zero():
    json.dump(res, open(f"{out}/result.json", "w"))
'''


def _run(cmd, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]


def test_hf_trainer_gains_sp_by_changing_the_class(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    _run([sys.executable, str(script), "plain", str(tmp_path / "plain")], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "sp",
          str(tmp_path / "sp")], tmp_path)
    plain = json.loads((tmp_path / "plain" / "result.json").read_text())
    sp = json.loads((tmp_path / "sp" / "result.json").read_text())
    assert sp["mesh"] == [2, 2, 1]  # really sequence-parallel: a ring of 2 ranks
    assert len(sp["losses"]) == len(plain["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(sp["losses"], plain["losses"])) <= 1e-5, (sp, plain)
    assert abs(sp["eval_loss"] - plain["ref_eval_loss"]) <= 1e-5, (sp["eval_loss"], plain["ref_eval_loss"])
    assert len(sp["dpo_losses"]) == len(plain["dpo_losses"]) == 4
    assert max(abs(a - b) for a, b in zip(sp["dpo_losses"], plain["dpo_losses"])) <= 1e-5, (sp, plain)
    assert "rewards/accuracies" in sp["dpo_metrics"]


@pytest.mark.slow
def test_hf_trainer_dp2_x_sp2_packed(tmp_path):
    """4 ranks = dp 2 x SP 2 (ring), packing, grad-accum 2: each step sees 8 rows, like the plain Trainer
    on one process with grad-accum 4; token-normalised losses must agree within 1e-5."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    _run([sys.executable, str(script), "plain", str(tmp_path / "plain"), "4", "1"], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script), "sp",
          str(tmp_path / "sp"), "2", "2"], tmp_path)
    plain = json.loads((tmp_path / "plain" / "result.json").read_text())
    sp = json.loads((tmp_path / "sp" / "result.json").read_text())
    assert sp["mesh"] == [2, 2, 1]
    assert len(sp["losses"]) == len(plain["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(sp["losses"], plain["losses"])) <= 1e-5, (sp, plain)
    assert abs(sp["eval_loss"] - plain["ref_eval_loss"]) <= 1e-5, (sp["eval_loss"], plain["ref_eval_loss"])
