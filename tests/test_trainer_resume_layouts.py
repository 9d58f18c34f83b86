"""The Trainer drop-ins resume a Trainer checkpoint written at another layout (`resume_from_checkpoint`).

One script, several phases per launch. Each case trains 2 steps at layout A (a callback stops the 4-step
schedule after step 2; save_steps 2), then resumes that checkpoint-2 at layout B and trains to step 4; the
reference is the same drop-in run uninterrupted for 4 steps in ONE process (SP = 1, dp 1). The global batch is
4 rows everywhere (dp x per_device_train_batch_size x gradient_accumulation_steps); 16 rows, shuffled
(reshuffled per epoch: 4 steps per epoch, so the resume at step 2 is mid-epoch). Compared, fp32, AdamW lr 1e-3:
the logged loss and the gradient norm (relative) of every step after the resume, and every final parameter,
within 1e-5. The resumed run must say what changed.

fast: SequenceParallelTrainer under FSDP2 (SHARDED_STATE_DICT: torch.distributed.checkpoint folders) SP 2 ->
SP 1 x dp 2 on 2 ranks; the TRL SFT drop-in under DDP from 2 ranks (SP 2) to one process; a resume with another
global batch is refused naming the fix. slow: FSDP2 FULL_STATE_DICT from 2 ranks (SP 2) to SP 1 x dp 2, the TRL
DPO drop-in SP 2 -> SP 1 x dp 2 (DDP), and DeepSpeed ZeRO-2: SP 2 -> SP 1 x dp 2 at the same world size (exact)
and a refusal at another world size that names the universal-checkpoint conversion.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from procs import run_command, run_script

TOL = 1e-5

SCRIPT = r'''
import contextlib, io, json, os, sys
import torch, datasets
from transformers import TrainerCallback

phases, out = json.loads(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(0)
WORDS = "the cat sat on a mat while dogs ran far and birds sang songs of long summer days".split()
sft_rows, pairs, text = [], [], lambda lo, hi: " ".join(
    WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g))
for i in range(16):
    n = int(torch.randint(20, 60, (1,), generator=g))
    ids = torch.randint(3, 64, (n,), generator=g).tolist()
    sft_rows.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
    pairs.append({"prompt": text(3, 10), "chosen": " " + text(2, 12), "rejected": " " + text(2, 12)})


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= self.step:
            control.should_training_stop = True


def stack_kwargs(stack, pdb, ga, universal):
    if stack.startswith("fsdp2"):
        cfg = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
        if stack == "fsdp2-sharded":
            cfg["state_dict_type"] = "SHARDED_STATE_DICT"
        return {"fsdp": "full_shard", "fsdp_config": cfg}
    if stack.startswith("zero"):
        ds = {"zero_optimization": {"stage": int(stack[4])}, "train_micro_batch_size_per_gpu": pdb,
              "gradient_accumulation_steps": ga}
        if universal:
            ds["checkpoint"] = {"load_universal": True}
        return {"deepspeed": ds}
    return {}


def run(p):
    from seqpar.hf import tiny_model, load_smollm2_tokenizer
    kind, sub, sp, pdb, ga = p["kind"], p["out"], p["sp"], p["pdb"], p["ga"]
    common = dict(output_dir=f"{out}/{sub}", per_device_train_batch_size=pdb, gradient_accumulation_steps=ga,
                  max_steps=4, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="steps", save_steps=2,
                  use_cpu=True, seed=0, disable_tqdm=True, bf16=False,  # TRL's configs default to bf16
                  **stack_kwargs(p["stack"], pdb, ga, p.get("universal")))
    cb = [StopAt(p["stop"])] if p.get("stop") else None
    if kind == "sp":
        from transformers import TrainingArguments
        from seqpar.hf.trainer import SequenceParallelTrainer
        model = tiny_model("llama", 4, 2, vocab_size=64, seed=0)
        t = SequenceParallelTrainer(model=model, args=TrainingArguments(**common), sequence_parallel_size=sp,
                                    train_dataset=datasets.Dataset.from_list(sft_rows), callbacks=cb)
    else:
        import trl
        import seqpar.trl as strl
        tok = load_smollm2_tokenizer()
        model = tiny_model("llama", 4, 2, vocab_size=len(tok), seed=0)
        if kind == "trl-sft":
            t = strl.SequenceParallelSFTTrainer(model=model, args=trl.SFTConfig(**common, max_length=256),
                                                train_dataset=datasets.Dataset.from_list(sft_rows),
                                                processing_class=tok, sequence_parallel_size=sp, callbacks=cb)
        else:
            t = strl.SequenceParallelDPOTrainer(model=model, args=trl.DPOConfig(**common, max_length=256, beta=0.5),
                                                train_dataset=datasets.Dataset.from_list(pairs), processing_class=tok,
                                                sequence_parallel_size=sp, callbacks=cb)
    said = io.StringIO()
    res = {}
    try:
        with contextlib.redirect_stdout(said):
            t.train(resume_from_checkpoint=f"{out}/{p['resume']}" if p.get("resume") else None)
    except Exception as e:
        if not p.get("expect_error"):
            raise
        res["error"] = f"{type(e).__name__}: {e}"
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if "error" not in res and p["stack"].startswith("zero"):
        params = {k: v.detach().clone() for k, v in t.model.named_parameters()}  # ZeRO-2: whole on every rank
    elif "error" not in res and torch.distributed.is_initialized():
        params = get_model_state_dict(t.model_wrapped if p["stack"].startswith("fsdp2") else t.model,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        params = {k: v.detach().clone() for k, v in t.model.named_parameters()}
    res.update(said=said.getvalue(), losses={h["step"]: h["loss"] for h in t.state.log_history if "loss" in h},
               grad_norms={h["step"]: h["grad_norm"] for h in t.state.log_history if "grad_norm" in h})
    if t.is_world_process_zero():
        torch.save(params, f"{out}/{sub}.params.pt")
    return res


results = {p["out"]: run(p) for p in phases}
if int(os.environ.get("RANK", "0")) == 0:
    json.dump(results, open(f"{out}/result_{phases[-1]['out']}.json", "w"))
'''


def _launch(tmp_path: Path, phases: list[dict], nproc: int) -> dict:
    script = tmp_path / "resume.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, str(script), json.dumps(phases), str(out)]
    if nproc > 1 or any(p["stack"].startswith("zero") for p in phases):  # one DeepSpeed process: torchrun too
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    result = out / f"result_{phases[-1]['out']}.json"
    run_script(cmd, tmp_path, result=result, timeout=500)
    return json.loads(result.read_text())


def _phase(kind: str, out: str, sp: int, dp: int, stack: str = "ddp", **kw) -> dict:
    """One phase; per_device_train_batch_size 2 and grad-accum 2 / dp (global batch 4)."""
    return {"kind": kind, "out": out, "sp": sp, "pdb": 2, "ga": 2 // dp, "stack": stack, **kw}


def _compare(name: str, tmp_path: Path, got: dict, want: dict) -> None:
    out = tmp_path / "out"
    steps = [3, 4]
    assert sorted(int(s) for s in got["losses"]) == [1, 2, 3, 4] or all(str(s) in got["losses"] for s in steps), got
    dloss = max(abs(got["losses"][str(s)] - want["losses"][str(s)]) for s in steps)
    dgn = max(abs(got["grad_norms"][str(s)] - want["grad_norms"][str(s)]) / max(1.0, want["grad_norms"][str(s)])
              for s in steps)
    a, b = torch.load(out / f"{got['name']}.params.pt"), torch.load(out / f"{want['name']}.params.pt")
    assert set(a) == set(b), (set(a) ^ set(b))
    dparam = max(float((a[k].float() - b[k].float()).abs().max()) for k in b)
    print(f"{name}: steps 3-4 max |dloss| {dloss:.2e}, max rel |dgrad_norm| {dgn:.2e}; final max |dparam| {dparam:.2e}")
    assert dloss <= TOL and dgn <= TOL and dparam <= TOL, (name, dloss, dgn, dparam)


def _named(results: dict) -> dict:
    return {k: dict(v, name=k) for k, v in results.items()}


def test_dropins_resume_on_another_layout(tmp_path):
    fsdp = _named(_launch(tmp_path, [
        _phase("sp", "fsdp_a", 2, 1, "fsdp2-sharded", stop=2),
        _phase("sp", "fsdp_b", 1, 2, "fsdp2-sharded", resume="fsdp_a/checkpoint-2")], 2))
    trl_a = _launch(tmp_path, [_phase("trl-sft", "trl_a", 2, 1, stop=2)], 2)
    one = _named(_launch(tmp_path, [
        _phase("sp", "sp_ref", 1, 1), _phase("trl-sft", "trl_ref", 1, 1),
        _phase("trl-sft", "trl_b", 1, 1, resume="trl_a/checkpoint-2"),
        dict(_phase("trl-sft", "trl_bad", 1, 1, resume="trl_a/checkpoint-2"), ga=1, expect_error=True)], 1))
    said = fsdp["fsdp_b"]["said"]
    assert "checkpoint-2 was written at world 2 (dp 1 x sp 2: ulysses 2 x ring 1, fsdp2), this run is world 2 " \
           "(dp 2 x sp 1: ulysses 1 x ring 1, fsdp2); global batch kept: 4 rows per step" in said, said
    assert "this run is world 1 (dp 1 x sp 1" in one["trl_b"]["said"], one["trl_b"]["said"]
    _compare("SequenceParallelTrainer FSDP2 (sharded) sp2 -> sp1 x dp2", tmp_path, fsdp["fsdp_b"], one["sp_ref"])
    _compare("SequenceParallelSFTTrainer DDP 2 ranks sp2 -> 1 process", tmp_path, one["trl_b"], one["trl_ref"])
    err = one["trl_bad"]["error"]
    assert "SeqParError" in err and "global batch of 4 rows" in err and "gradient_accumulation_steps=2" in err, err
    assert trl_a["trl_a"]["losses"]


def _universal(tmp_path: Path, ckpt: str) -> None:
    """What the refusal says to do: DeepSpeed's conversion to a universal checkpoint, and latest_universal."""

    folder = tmp_path / "out" / ckpt
    r = run_command([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state",
             "--input_folder", str(folder / "global_step2"), "--output_folder", str(folder / "global_step2_universal")],
            timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (folder / "latest_universal").write_text("global_step2_universal")


@pytest.mark.slow
def test_dropins_resume_more_stacks(tmp_path):
    """FSDP2 FULL_STATE_DICT and the TRL DPO drop-in: SP 2 -> SP 1 x dp 2. DeepSpeed ZeRO-2: SP 2 -> SP 1 x dp 2
    at the same world size; at 1 rank refused (naming the conversion), then resumed exactly after DeepSpeed's
    universal-checkpoint conversion with load_universal."""
    # One stack per launch: accelerate keeps its state (FSDP / DeepSpeed plugins) per process.
    full = _named(_launch(tmp_path, [
        _phase("sp", "full_a", 2, 1, "fsdp2", stop=2),
        _phase("sp", "full_b", 1, 2, "fsdp2", resume="full_a/checkpoint-2")], 2))
    dpo = _named(_launch(tmp_path, [
        _phase("trl-dpo", "dpo_a", 2, 1, stop=2), _phase("trl-dpo", "dpo_b", 1, 2, resume="dpo_a/checkpoint-2")], 2))
    zero = _named(_launch(tmp_path, [
        _phase("sp", "zero_a", 2, 1, "zero2", stop=2),
        _phase("sp", "zero_b", 1, 2, "zero2", resume="zero_a/checkpoint-2")], 2))
    refused = _launch(tmp_path, [dict(_phase("sp", "zero_bad", 1, 1, "zero2", resume="zero_a/checkpoint-2"),
                                      expect_error=True)], 1)["zero_bad"]["error"]
    assert "deepspeed-zero2 checkpoint of 2 ranks" in refused and "ds_to_universal --inject_missing_state" in refused \
        and "load_universal" in refused, refused
    _universal(tmp_path, "zero_a/checkpoint-2")
    universal = _named(_launch(tmp_path, [
        _phase("sp", "zero_u", 1, 1, "zero2", resume="zero_a/checkpoint-2", universal=True)], 1))
    one = _named(_launch(tmp_path, [_phase("sp", "sp_ref", 1, 1), _phase("trl-dpo", "dpo_ref", 1, 1)], 1))
    _compare("SequenceParallelTrainer FSDP2 (full) sp2 -> sp1 x dp2", tmp_path, full["full_b"], one["sp_ref"])
    _compare("SequenceParallelDPOTrainer (TRL) DDP sp2 -> sp1 x dp2", tmp_path, dpo["dpo_b"], one["dpo_ref"])
    _compare("SequenceParallelTrainer ZeRO-2 sp2 -> sp1 x dp2 (same world)", tmp_path, zero["zero_b"], one["sp_ref"])
    _compare("SequenceParallelTrainer ZeRO-2 2 ranks -> 1 (universal checkpoint)", tmp_path, universal["zero_u"],
             one["sp_ref"])


def test_check_resume_rules(tmp_path):
    """seqpar.hf.trainer_resume.check_resume on recorded layouts (no training): the same layout says nothing;
    another one says what changed (and when dp does not divide the rows); another global batch, DeepSpeed at
    another world size without a universal checkpoint, and ZeRO-3 at another world size are refused."""
    from types import SimpleNamespace

    from seqpar.errors import SeqParError
    from seqpar.hf.trainer_resume import LAYOUT_FILE, check_resume, trainer_layout

    class DS:
        def __init__(self, stage, universal=False):
            self.v = {"zero_optimization.stage": stage, "checkpoint.load_universal": universal}

        def get_value(self, key, default=None):
            return self.v.get(key, default)

    def trainer(world, sp, pdb, ga, ds=None, rows=16):
        mesh = SimpleNamespace(world_size=world, dp_size=world // sp, sp_size=sp, ulysses_degree=1, ring_degree=sp)
        args = SimpleNamespace(per_device_train_batch_size=pdb, gradient_accumulation_steps=ga, hf_deepspeed_config=ds,
                               deepspeed_plugin=None)
        return SimpleNamespace(sp_mesh=mesh, args=args, is_fsdp_enabled=False, train_dataset=[0] * rows)

    def saved(t, name="checkpoint-2"):
        folder = tmp_path / f"{len(list(tmp_path.iterdir()))}" / name
        folder.mkdir(parents=True)
        (folder / LAYOUT_FILE).write_text(json.dumps(trainer_layout(t)))
        return str(folder)

    ck = saved(trainer(2, 2, 2, 2))
    assert check_resume(trainer(2, 2, 2, 2), ck) == []
    note = check_resume(trainer(4, 2, 1, 2, rows=15), ck)
    assert "was written at world 2 (dp 1 x sp 2: ulysses 1 x ring 2, ddp), this run is world 4 (dp 2 x sp 2" in note[0]
    assert "15 training rows are not a multiple of dp 1 and 2" in note[1], note
    with pytest.raises(SeqParError, match=r"global batch of 4 rows .* has 8 .*\(gradient_accumulation_steps=1\)"):
        check_resume(trainer(4, 2, 2, 2), ck)
    for stage in (2, 3):
        ds_ck = saved(trainer(2, 2, 2, 2, DS(stage)))
        assert check_resume(trainer(2, 1, 2, 1, DS(stage)), ds_ck)  # same world, SP 2 -> 1: fine, announced
        with pytest.raises(SeqParError, match="ds_to_universal" if stage == 2 else "ZeRO-3 checkpoint at 2 ranks only"):
            check_resume(trainer(1, 1, 2, 2, DS(stage, universal=True)), ds_ck)  # no latest_universal written
    Path(ds_ck, "latest_universal").write_text("global_step2_universal")
    with pytest.raises(SeqParError, match="does not restore the optimizer exactly"):
        check_resume(trainer(1, 1, 2, 2, DS(3, universal=True)), ds_ck)
    z2 = saved(trainer(2, 2, 2, 2, DS(2)))
    Path(z2, "latest_universal").write_text("global_step2_universal")
    assert check_resume(trainer(1, 1, 2, 2, DS(2, universal=True)), z2)  # converted: resumes (and says so)
