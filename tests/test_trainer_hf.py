"""An HF Trainer script gains SP by changing the class.

The same script runs (a) with `transformers.Trainer` in one process and (b) with
`SequenceParallelTrainer` under torchrun on 2 ranks (tiny Llama with 3 q / 1 kv heads, so the
auto mesh is a zigzag ring of 2). Per-step logged training losses and the final parameters must
agree within 1e-5 (fp32, grad accumulation 2, SGD lr 0.1 without clipping: unlike AdamW or
clipping, SGD is not blind to a gradient-scale error), and the SP `evaluate()` must equal an
independent one-process global token-mean CE of the plain run's final model within 1e-5. The script then runs
`SequenceParallelDPOTrainer` at SP=2 and at SP=1 (one process), SGD lr 0.1 with max_grad_norm 1.0: every step's
gradient norm before clipping (1e-5 relative), the losses and the final parameters within 1e-5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from procs import SFT_ROWS_SCRIPT, plain_and_sp, run_script

SCRIPT = r'''
import json, os, sys
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

def args(sub, **kw):
    return TrainingArguments(output_dir=f"{out}/{sub}", per_device_train_batch_size=2, gradient_accumulation_steps=ga,
                             max_steps=4, logging_steps=1, report_to=[], save_strategy="no",
                             train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True,
                             **{"learning_rate": 1e-2, **kw})

arch = os.environ.get("SEQPAR_TEST_ARCH", "llama")  # hybrids: the recurrent layers pass state around the ring
model = tiny_model(arch, 3, 1, vocab_size=64, seed=0)
Cls = SequenceParallelTrainer if mode == "sp" else Trainer          # <- the change
collate = pad_collate if mode == "plain" else None                  # <- and seqpar builds the SP collator
trainer = Cls(model=model, args=args("sft", optim="sgd", learning_rate=0.1, max_grad_norm=1.0), train_dataset=ds,
              eval_dataset=ds, data_collator=collate, **(sp_kw if mode == "sp" else {}))
trainer.train()
res = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
       "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}
if trainer.is_world_process_zero():
    torch.save({k: v.detach() for k, v in model.named_parameters()}, f"{out}/sft_params.pt")
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
dpo = SequenceParallelDPOTrainer(model=tiny_model(arch, 3, 1, vocab_size=64, seed=1),
                                 args=args("dpo", optim="sgd", learning_rate=0.1, max_grad_norm=1.0),
                                 train_dataset=datasets.Dataset.from_list(pairs), beta=0.5)
dpo.train()
res["dpo_losses"] = [h["loss"] for h in dpo.state.log_history if "loss" in h]
res["dpo_grad_norms"] = [h["grad_norm"] for h in dpo.state.log_history if "grad_norm" in h]
if dpo.is_world_process_zero():
    torch.save({k: v.detach() for k, v in dpo.model.named_parameters()}, f"{out}/dpo_params.pt")
res["dpo_metrics"] = sorted(k for h in dpo.state.log_history for k in h if k.startswith("rewards/"))
if trainer.is_world_process_zero():
    json.dump(res, open(f"{out}/result.json", "w"))
'''


def _run(cmd, tmp_path):
    script = next(i for i, a in enumerate(cmd) if a.endswith(".py"))
    run_script(cmd, tmp_path, result=Path(cmd[script + 2]) / "result.json")  # args: script mode out ...


def _param_err(tmp_path, stage: str = "sft"):
    import torch

    a = torch.load(tmp_path / "plain" / f"{stage}_params.pt")
    b = torch.load(tmp_path / "sp" / f"{stage}_params.pt")
    assert a.keys() == b.keys() and len(a) > 0
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _check_grad_norms(sp: dict, plain: dict, key: str = "grad_norms") -> None:
    """Every step's gradient norm before clipping (max_grad_norm 1.0, the Trainer's default) at 1e-5 relative."""
    assert len(sp[key]) == len(plain[key]) == 4, (sp, plain)
    assert max(abs(a - b) / b for a, b in zip(sp[key], plain[key])) <= 1e-5, (sp, plain)


def test_hf_trainer_gains_sp_by_changing_the_class(tmp_path):
    _gains_sp(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h", "lfm2", "falcon_h1", "jamba", "kimi_linear", "minimax",
                                  "recurrent_gemma"])
def test_hf_trainer_hybrids_ring(tmp_path, monkeypatch, arch):
    """The same script with a hybrid of each recurrence kind: Gated DeltaNet (Qwen3.5), Mamba2 (Nemotron-H;
    Falcon-H1, its lm_head_multiplier in the fused loss), short conv (LFM2), Mamba1 (Jamba), KDA (Kimi-Linear),
    lightning (MiniMax), RG-LRU (RecurrentGemma): 3 q / 1 kv softmax heads make the automatic mesh a ring of 2, so
    the recurrent layers pass state (SFT + SP evaluate + DPO)."""
    monkeypatch.setenv("SEQPAR_TEST_ARCH", arch)
    _gains_sp(tmp_path)


def _gains_sp(tmp_path):
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
    _check_grad_norms(sp, plain)
    assert _param_err(tmp_path) <= 1e-5, _param_err(tmp_path)
    print(f"SFT SP=2 vs stock Trainer: max |dparam| after 4 SGD steps = {_param_err(tmp_path):.2e}")
    assert abs(sp["eval_loss"] - plain["ref_eval_loss"]) <= 1e-5, (sp["eval_loss"], plain["ref_eval_loss"])
    assert len(sp["dpo_losses"]) == len(plain["dpo_losses"]) == 4
    assert max(abs(a - b) for a, b in zip(sp["dpo_losses"], plain["dpo_losses"])) <= 1e-5, (sp, plain)
    _check_grad_norms(sp, plain, "dpo_grad_norms")
    assert _param_err(tmp_path, "dpo") <= 1e-5, _param_err(tmp_path, "dpo")
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
    _check_grad_norms(sp, plain)
    assert _param_err(tmp_path) <= 1e-5, _param_err(tmp_path)
    assert abs(sp["eval_loss"] - plain["ref_eval_loss"]) <= 1e-5, (sp["eval_loss"], plain["ref_eval_loss"])


# ----------------------------------------------------------------------------- checkpoint resume
RESUME_SCRIPT = r'''
import json, sys
import torch, datasets
from transformers import Trainer, TrainerCallback, TrainingArguments
from seqpar.hf import tiny_model
from seqpar.hf.trainer import SequenceParallelTrainer

mode, out = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)
rows = []
for i in range(8):  # batch 2 -> 4 optimizer steps per epoch
    n = int(torch.randint(20, 60, (1,), generator=g))
    ids = torch.randint(3, 64, (n,), generator=g).tolist()
    rows.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:], "row": i})
ds = datasets.Dataset.from_list(rows)


class Recording(SequenceParallelTrainer):
    """Records which rows each optimizer step saw (the collator drops the "row" column)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append([self.state.global_step + 1, int(inputs["input_ids"].sum())])
        return super().training_step(model, inputs, num_items_in_batch)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def run(sub, resume=None, stop=None):
    args = TrainingArguments(output_dir=f"{out}/{sub}", per_device_train_batch_size=2, max_steps=8,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="steps",
                             save_steps=3, use_cpu=True, seed=0, disable_tqdm=True)
    model = tiny_model("llama", 3, 1, vocab_size=64, seed=0)
    t = Recording(model=model, args=args, train_dataset=ds, callbacks=[StopAt(stop)] if stop else None)
    t.seen = []
    t.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return t, losses, params


full, la, pa = run("full")                         # 8 steps straight, saves checkpoints 3 and 6
res = {"mesh": [full.sp_mesh.sp_size, full.sp_mesh.ring_degree, full.sp_mesh.ulysses_degree],
       "full_losses": la, "full_seen": full.seen}
_, _, p3 = run("stop3", stop=3)                    # the same schedule, stopped after step 3
for ck in ("stop3/checkpoint-3", "full/checkpoint-6"):  # mid epoch 0 and mid epoch 1
    t, lb, pb = run("res" + ck[-1], resume=f"{out}/{ck}")
    res[ck] = {"losses": lb, "seen": t.seen,
               "param_err": max(float((pa[k] - pb[k]).abs().max()) for k in pa)}
if full.is_world_process_zero():
    json.dump(res, open(f"{out}/result.json", "w"))
'''


def test_hf_trainer_resume_mid_epoch_is_exact(tmp_path):
    """SP=2 (zigzag ring), shuffled sampling, 4 steps per epoch, linear LR over 8 steps, checkpoints every 3.
    Resuming from checkpoint-3 (a run stopped there by a callback: same schedule) and from checkpoint-6 (mid
    epoch 1, where the sampler must reshuffle for epoch 1 after accelerate's skip_first_batches) must see the
    same rows at every step and end on the uninterrupted run's parameters (max |diff| <= 1e-6; measured
    0.0) with the same per-step losses (<= 1e-6)."""
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "sp",
          str(tmp_path / "out")], tmp_path)
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    assert res["mesh"] == [2, 2, 1]
    full, seen = res["full_losses"], res["full_seen"]
    assert len(full) == 8 and len(seen) == 8
    assert seen[4:] != seen[:4]  # epoch 1 is reshuffled, so replaying epoch 0 would be caught
    for ck, first in (("stop3/checkpoint-3", 4), ("full/checkpoint-6", 7)):
        r = res[ck]
        assert r["seen"] == seen[first - 1:], (ck, r["seen"], seen)  # the right rows after the resume point
        for step in range(first, 9):
            assert abs(r["losses"][str(step)] - full[str(step)]) <= 1e-6, (ck, step, r["losses"], full)
        assert r["param_err"] <= 1e-6, (ck, r["param_err"])


# ----------------------------------------------------------------------------- LoRA (PEFT)
LORA_SCRIPT = r'''
import json, sys
import torch, datasets
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments
from seqpar.hf import tiny_model
from seqpar.hf.trainer import SequenceParallelTrainer

mode, out = sys.argv[1], sys.argv[2]
''' + SFT_ROWS_SCRIPT + r'''  # its first 6 rows are the 3 steps' batches
args = TrainingArguments(output_dir=f"{out}/lora", per_device_train_batch_size=2, gradient_accumulation_steps=1,
                         max_steps=3, learning_rate=0.5, optim="sgd", max_grad_norm=0.0,  # scale-sensitive
                         logging_steps=1, report_to=[], save_strategy="no",
                         train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True)
base = tiny_model("llama", 3, 1, vocab_size=64, seed=0)
torch.manual_seed(0)  # LoRA A init
model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                        lora_dropout=0.0))
Cls = SequenceParallelTrainer if mode == "sp" else Trainer          # <- the change
collate = pad_collate if mode == "plain" else None                  # <- and seqpar builds the SP collator
trainer = Cls(model=model, args=args, train_dataset=ds, data_collator=collate)
trainer.train()
res = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
       "lora": {k: v.detach().flatten().tolist() for k, v in model.named_parameters() if v.requires_grad},
       "n_frozen": sum(1 for _, v in model.named_parameters() if not v.requires_grad)}
if mode == "sp":
    res["mesh"] = [trainer.sp_mesh.sp_size, trainer.sp_mesh.ring_degree, trainer.sp_mesh.ulysses_degree]
if trainer.is_world_process_zero():
    json.dump(res, open(f"{out}/result.json", "w"))
'''


def test_hf_trainer_lora_matches_plain_trainer(tmp_path):
    """A PEFT LoRA model (q/v/o, r=4) trained 3 steps (SGD lr 0.5, no clipping: a gradient-scale error would
    show) by SequenceParallelTrainer on 2 ranks (zigzag ring) equals the same script with the stock Trainer in
    one process: losses within 1e-5, every trainable LoRA parameter within 1e-6, the same parameters frozen."""
    plain, sp = plain_and_sp(LORA_SCRIPT, tmp_path)
    assert sp["mesh"] == [2, 2, 1]
    assert len(sp["losses"]) == len(plain["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(sp["losses"], plain["losses"])) <= 1e-5, (sp["losses"], plain["losses"])
    assert sorted(sp["lora"]) == sorted(plain["lora"]) and all("lora_" in k for k in sp["lora"])
    assert sp["n_frozen"] == plain["n_frozen"] > 0
    assert any(abs(x) > 1e-4 for k, v in sp["lora"].items() if "lora_B" in k for x in v)  # B (init 0) trained
    err = max(abs(a - b) for k in plain["lora"] for a, b in zip(plain["lora"][k], sp["lora"][k]))
    print(f"LoRA SP=2 vs stock Trainer: max |dparam| = {err:.2e}")
    assert err <= 1e-6, err


# ----------------------------------------------------------------------------- DPO vs the formula; eval rows
DPO_EVAL_SCRIPT = r"""
import copy, json, os, sys
import torch, datasets
import torch.nn.functional as F
from transformers import TrainingArguments
from seqpar.hf import tiny_model
from seqpar.hf.trainer import SequenceParallelDPOTrainer, SequenceParallelTrainer

out, sp = sys.argv[1], int(sys.argv[2])
dp = int(os.environ["WORLD_SIZE"]) // sp
BETA, LR, STEPS = 0.5, 0.5, 2
g = torch.Generator().manual_seed(0)
def ids(lo, hi):
    return torch.randint(3, 64, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
pairs = [{"prompt_input_ids": ids(3, 12), "chosen_input_ids": ids(2, 20), "rejected_input_ids": ids(2, 20)}
         for _ in range(4)]

def args(sub, bs, **kw):
    return TrainingArguments(output_dir=f"{out}/{sub}", per_device_train_batch_size=bs, per_device_eval_batch_size=2,
                             max_steps=STEPS, learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
                             max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, report_to=[], save_strategy="no",
                             train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True, **kw)

# Independent reference: the unsharded HF model, the DPO sigmoid formula by hand, torch.optim.SGD.
# Every step sees all 4 pairs (one step = one epoch), so the pair order within a step does not matter.
policy0 = tiny_model("llama", 3, 1, vocab_size=64, seed=1)
frozen = copy.deepcopy(policy0).eval().requires_grad_(False)
plain = copy.deepcopy(policy0)
opt = torch.optim.SGD(plain.parameters(), lr=LR)

def seq_logp(model, prompt, comp):
    x = torch.tensor([prompt + comp])
    lp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:].sum()  # the completion tokens' log-probs

ref_losses = []
for _ in range(STEPS):
    terms = []
    for p in pairs:
        pc, pr = (seq_logp(plain, p["prompt_input_ids"], p[k]) for k in ("chosen_input_ids", "rejected_input_ids"))
        with torch.no_grad():
            rc, rr = (seq_logp(frozen, p["prompt_input_ids"], p[k]) for k in ("chosen_input_ids", "rejected_input_ids"))
        terms.append(-F.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
    loss = torch.stack(terms).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ref_losses.append(float(loss.detach()))

policy = copy.deepcopy(policy0)
dpo = SequenceParallelDPOTrainer(model=policy, args=args("dpo", len(pairs) // dp),
                                 train_dataset=datasets.Dataset.from_list(pairs), beta=BETA,
                                 sequence_parallel_size=sp)
dpo.train()
want = dict(plain.named_parameters())
res = {"mesh": [dpo.sp_mesh.dp_size, dpo.sp_mesh.sp_size],
       "dpo_losses": [h["loss"] for h in dpo.state.log_history if "loss" in h], "ref_losses": ref_losses,
       "param_err": max(float((p - want[n]).abs().max()) for n, p in policy.named_parameters()),
       "moved": max(float((p - q).abs().max()) for p, q in zip(plain.parameters(), policy0.parameters()))}

# evaluate() over dp ranks with an eval set of 5 rows (not a multiple of dp): each row counted once.
rows = []
for i in range(5):
    x = ids(10, 40)
    rows.append({"input_ids": x, "labels": [-100] * 3 + x[3:]})
model = tiny_model("llama", 3, 1, vocab_size=64, seed=0)
tot, cnt = 0.0, 0
with torch.no_grad():
    for r in rows:
        logits = model(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1]
        lab = torch.tensor(r["labels"][1:])
        tot += float(F.cross_entropy(logits, lab, ignore_index=-100, reduction="sum"))
        cnt += int((lab != -100).sum())
ev = SequenceParallelTrainer(model=model, args=args("eval", 1), eval_dataset=datasets.Dataset.from_list(rows),
                             sequence_parallel_size=1)
m = ev.evaluate()
res.update(eval_mesh=[ev.sp_mesh.dp_size, ev.sp_mesh.sp_size], eval_loss=m["eval_loss"], eval_items=m["eval_items"],
           ref_eval_loss=tot / cnt, ref_eval_items=cnt)
if dpo.is_world_process_zero():
    json.dump(res, open(f"{out}/result.json", "w"))
"""


def _dpo_eval(tmp_path, nproc, sp):
    script = tmp_path / "dpo_eval.py"
    script.write_text(DPO_EVAL_SCRIPT)
    # args: script out sp (not _run's script mode out): name the result file, so the upstream teardown abort
    # after a finished run (tests/procs.py) is told apart from a failure
    run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                str(script), str(tmp_path / "out"), str(sp)], tmp_path, result=tmp_path / "out" / "result.json")
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    dloss = max(abs(a - b) for a, b in zip(res["dpo_losses"], res["ref_losses"]))
    print(f"DPO dp{res['mesh'][0]} x sp{res['mesh'][1]} vs hand formula: max |dloss| = {dloss:.2e}, "
          f"max |dparam| = {res['param_err']:.2e} (moved {res['moved']:.2e}); eval |d| = "
          f"{abs(res['eval_loss'] - res['ref_eval_loss']):.2e}")
    assert res["mesh"] == [nproc // sp, sp]
    assert len(res["dpo_losses"]) == len(res["ref_losses"]) == 2 and dloss <= 1e-5, res
    assert res["param_err"] <= 1e-5 and res["moved"] > 1e-3, res
    assert res["eval_mesh"] == [nproc, 1]
    assert res["eval_items"] == res["ref_eval_items"], res  # every eval row counted exactly once
    assert abs(res["eval_loss"] - res["ref_eval_loss"]) <= 1e-5, res
    return res


def test_hf_dpo_trainer_matches_hand_written_dpo_and_eval_counts_rows_once(tmp_path):
    """SequenceParallelDPOTrainer at SP=2 (zigzag ring), SGD lr 0.5, 2 steps over 4 pairs, against the unsharded
    model with the DPO sigmoid formula written by hand and torch.optim.SGD: logged losses and parameters after
    2 steps within 1e-5. Then evaluate() at dp=2 (SP=1 per group) on 5 eval rows: eval_items equals the 5 rows'
    supervised-token count and eval_loss the one-process token-mean CE within 1e-5 (the old wrap-around sampler
    counted row 0 twice)."""
    _dpo_eval(tmp_path, 2, 2)


@pytest.mark.slow
def test_hf_dpo_trainer_matches_hand_written_dpo_dp2_x_sp2(tmp_path):
    """The same at dp 2 x SP 2 (4 ranks; evaluate() at dp=4 over 5 rows)."""
    _dpo_eval(tmp_path, 4, 2)


def test_hf_trainer_refuses_what_it_cannot_do_under_sp(tmp_path):
    """What would silently do something else under SP is a SeqParError naming the alternative (one process, SP=1):
    include_for_metrics 'loss', compute_metrics / preprocess_logits_for_metrics / predict() for DPO, a
    preprocess_logits_for_metrics that does not keep positions, prediction_step(), length-grouped sampling and a
    foreign data_collator. compute_metrics and predict() themselves work (tests/test_trainer_hf_metrics.py)."""
    import datasets
    from transformers import TrainingArguments

    from seqpar.errors import SeqParError
    from seqpar.hf import tiny_model
    from seqpar.hf.trainer import SequenceParallelDPOTrainer, SequenceParallelTrainer

    ds = datasets.Dataset.from_list([{"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8]}] * 2)
    pairs = datasets.Dataset.from_list([{"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 8],
                                         "rejected_input_ids": [9, 10]}] * 2)

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path / "t"), report_to=[], use_cpu=True, disable_tqdm=True, **kw)

    def make(cls=SequenceParallelTrainer, a=None, **kw):
        rows = pairs if cls is SequenceParallelDPOTrainer else ds  # each drop-in refuses the other's rows
        return cls(model=tiny_model("llama", 2, 1, vocab_size=64, seed=0), args=a or args(), train_dataset=rows, **kw)

    with pytest.raises(SeqParError, match="include_for_metrics=\\['loss'\\]: 'loss' is not supported.*drop 'loss'"):
        make(a=args(include_for_metrics=["loss"]), compute_metrics=lambda p: {})
    with pytest.raises(SeqParError, match="preprocess_logits_for_metrics= is not supported for DPO.*drop it"):
        make(SequenceParallelDPOTrainer, preprocess_logits_for_metrics=lambda a, b: a)
    with pytest.raises(SeqParError, match="compute_metrics= is not supported for DPO"):
        make(SequenceParallelDPOTrainer, compute_metrics=lambda p: {})
    for strategy in ("group_by_length", "batch_rebalance"):
        with pytest.raises(SeqParError, match=f"train_sampling_strategy='{strategy}'.*'random' or 'sequential'"):
            make(a=args(train_sampling_strategy=strategy))
    with pytest.raises(SeqParError, match="data_collator=my_collate is not a seqpar collator.*drop data_collator="):
        def my_collate(rows):
            return rows
        make(data_collator=my_collate)
    with pytest.raises(SeqParError, match="predict\\(\\) is not supported for DPO.*evaluate\\(\\)"):
        make(SequenceParallelDPOTrainer).predict(pairs)
    t = make(eval_dataset=ds, compute_metrics=lambda p: {"rows": len(p.label_ids)},
             preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1).sum(-1))  # mixes positions
    with pytest.raises(SeqParError, match="preprocess_logits_for_metrics returned \\(2,\\).*position by position"):
        t.evaluate()
    with pytest.raises(SeqParError, match="prediction_step\\(\\) is not supported.*with compute_metrics="):
        t.prediction_step(t.model, {}, prediction_loss_only=True)
    t.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    m = t.evaluate()  # what it offers instead
    assert m["eval_items"] == 6 and m["eval_loss"] > 0 and m["eval_rows"] == 2
    p = t.predict(ds)
    assert p.predictions.shape == p.label_ids.shape == (2, 4) and p.metrics["test_items"] == 6
    assert p.label_ids.tolist() == [[-100, 6, 7, 8]] * 2
