"""The run lifecycle: HF exports (loaded in a FRESH process, logits vs the trained weights at 1e-6),
`seqpar export`, the output_dir lock, resume rules, the non-finite-loss guard.

Reference for an export: the trained weights as `checkpoint.save_final` wrote them (final_state.pt,
a plain state dict) loaded into a plain HF tiny model (+ a plain PEFT wrapper for LoRA) in this
process; the export is loaded by transformers / peft alone in a separate Python process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from procs import communicate, run_command, spawned

from seqpar.spawn import run_distributed

TOL = 1e-6
LORA = {"method": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "o_proj"]}
ROWS = [("alpha beta", "gamma delta epsilon"), ("zeta", "eta theta iota kappa"), ("mu nu xi", "omicron pi alpha"),
        ("beta", "delta delta gamma"), ("pi rho", "sigma tau"), ("kappa", "lambda mu nu xi")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("lifecycle")
    with open(d / "sft.jsonl", "w") as f:
        for i, r in ROWS:
            f.write(json.dumps({"instruction": i, "response": r}) + "\n")
    return d


def _cfg(data, out, **over):
    cfg = {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(data / "sft.jsonl"), "max_length": 64},
        "micro_batch_size": 2,
        "max_steps": 2,
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"save_final": True, "every": 1},
        "output_dir": str(out),
        "progress": False,
    }
    cfg.update(over)
    return cfg


def _train(cfg: dict):
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    return train(config_from_dict(cfg))


def _train_many(cases):
    return [_train(c).export_path for c in cases]


IDS = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))

LOADER = textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    jobs, ids_path, out_path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    ids = torch.load(ids_path)
    out = {}
    for name, kind, path in jobs:
        if kind == "lora":
            from peft import PeftModel
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path + "/base"), path)
        else:
            model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            out[name] = model.eval()(input_ids=ids).logits
        out[name + ":attn"] = model.config._attn_implementation
    torch.save(out, out_path)
""")


def _fresh_logits(tmp_path, jobs):
    """Load each export with transformers/peft in a new Python process; its logits on IDS."""
    torch.save(IDS, tmp_path / "ids.pt")
    r = run_command([sys.executable, "-c", LOADER, json.dumps(jobs), str(tmp_path / "ids.pt"),
                     str(tmp_path / "logits.pt")], timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp_path / "logits.pt")


def _reference_logits(state_path, lora: bool):
    """Plain HF tiny model (+ plain PEFT) with the saved trained weights."""
    from seqpar.hf import tiny_model

    model = tiny_model("llama", 4, 2, num_layers=2, vocab_size=259, seed=0)
    state = torch.load(state_path)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA["targets"], bias="none"))
        res = model.load_state_dict(state, strict=False)
        assert not res.unexpected_keys and all("lora_" not in k for k in res.missing_keys)
        assert state and all("lora_" in k for k in state)
    else:
        model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def _max_err(a, b):
    return float((a - b).abs().max())


def _check_export_dir(path, lora: bool):
    cfg_text = open(os.path.join(path, "adapter_config.json" if lora else "config.json")).read()
    assert "seqpar" not in cfg_text
    if lora:
        from safetensors import safe_open

        with safe_open(os.path.join(path, "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all("lora_" in k for k in keys), keys  # the adapter only
        assert "seqpar" not in open(os.path.join(path, "base", "config.json")).read()
    info = json.loads(open(os.path.join(path, "seqpar_export.json")).read())
    assert info["method"] == ("lora" if lora else "full")
    from seqpar.train.lifecycle.export import load_exported_tokenizer
    from seqpar.train.model.tokenizers import ByteTokenizer

    assert isinstance(load_exported_tokenizer(path), ByteTokenizer)


def _seqpar(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_command([sys.executable, "-m", "seqpar", *args], env=env, timeout=timeout)


def test_export_lora_full_and_checkpoint(data, tmp_path):
    """One process: LoRA (+ merged) and full exports and `seqpar export checkpoint-1` load in a fresh
    process and give the trained model's logits (max |dlogit| <= 1e-6)."""
    full = _train(_cfg(data, tmp_path / "full"))
    lora = _train(_cfg(data, tmp_path / "lora", finetuning=LORA, export={"final": True, "merged_lora": True}))
    lora1 = _train(_cfg(data, tmp_path / "lora1", finetuning=LORA, max_steps=1))  # reference for checkpoint-1
    r = _seqpar("export", str(tmp_path / "lora" / "checkpoint-1"), str(tmp_path / "lora_ck1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported" in r.stdout
    _check_export_dir(full.export_path, lora=False)
    _check_export_dir(lora.export_path, lora=True)
    got = _fresh_logits(tmp_path, [("full", "full", full.export_path), ("lora", "lora", lora.export_path),
                                   ("merged", "full", lora.export_path + "/merged"),
                                   ("ck1", "lora", str(tmp_path / "lora_ck1"))])
    errs = {
        "full": _max_err(got["full"], _reference_logits(full.final_state_path, lora=False)),
        "lora": _max_err(got["lora"], _reference_logits(lora.final_state_path, lora=True)),
        "merged": _max_err(got["merged"], _reference_logits(lora.final_state_path, lora=True)),
        "ck1": _max_err(got["ck1"], _reference_logits(lora1.final_state_path, lora=True)),
    }
    print("export max |dlogit|:", errs)
    assert got["full:attn"] == "sdpa" and got["lora:attn"] == "sdpa"
    # Merged: W + scale * B @ A is rounded once into W, so it is the same function only to fp32 rounding.
    assert errs["merged"] <= 1e-5, errs
    assert max(v for k, v in errs.items() if k != "merged") <= TOL, errs
    # The LoRA adapter actually trained: its logits differ from the base model's.
    base = _fresh_logits(tmp_path, [("base", "full", lora.export_path + "/base")])["base"]
    assert _max_err(base, got["lora"]) > 1e-3


def test_export_fsdp_two_ranks(data, tmp_path):
    """FSDP2 + SP=2 on 2 ranks: the final export (full state gathered to rank 0) and `seqpar export` of the
    sharded checkpoint-1 load in a fresh process with the trained logits (<= 1e-6)."""
    over = {"fsdp": True, "sequence_parallel": {"size": 2}}
    cases = [_cfg(data, tmp_path / "fsdp", **over), _cfg(data, tmp_path / "fsdp1", max_steps=1, **over)]
    paths = run_distributed(_train_many, 2, cases, timeout=600)[0]
    assert paths[0] == str(tmp_path / "fsdp" / "final")
    r = _seqpar("export", str(tmp_path / "fsdp" / "checkpoint-1"), str(tmp_path / "fsdp_ck1"))
    assert r.returncode == 0, r.stderr[-3000:]
    _check_export_dir(paths[0], lora=False)
    got = _fresh_logits(tmp_path, [("final", "full", paths[0]), ("ck1", "full", str(tmp_path / "fsdp_ck1"))])
    errs = {"final": _max_err(got["final"], _reference_logits(tmp_path / "fsdp" / "final_state.pt", lora=False)),
            "ck1": _max_err(got["ck1"], _reference_logits(tmp_path / "fsdp1" / "final_state.pt", lora=False))}
    print("fsdp export max |dlogit|:", errs)
    assert max(errs.values()) <= TOL, errs


def test_hf_trainer_drops_unsupervised_rows(tmp_path, capsys):
    """SequenceParallelTrainer drops (and reports) rows with no supervised token, like `seqpar train`: its
    logged losses equal the stock Trainer's on the supervised rows only (1e-5), none is a 0-loss step."""
    import datasets
    from transformers import Trainer, TrainingArguments

    from seqpar.hf import tiny_model
    from seqpar.hf.trainer import SequenceParallelTrainer

    g = torch.Generator().manual_seed(0)
    good = []
    for _ in range(4):
        ids = torch.randint(3, 64, (20,), generator=g).tolist()
        good.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
    ids = torch.randint(3, 64, (20,), generator=g).tolist()
    bad = [{"input_ids": ids, "labels": [-100] * 20},                     # nothing supervised
           {"input_ids": ids, "labels": [-100] * 18 + ids[18:]}]          # supervised only beyond max_length=16

    def pad_collate(batch):
        return {"input_ids": torch.tensor([r["input_ids"][:16] for r in batch]),
                "labels": torch.tensor([r["labels"][:16] for r in batch])}

    def args(sub):
        return TrainingArguments(output_dir=str(tmp_path / sub), per_device_train_batch_size=2, max_steps=2,
                                 learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                                 train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True)

    sp = SequenceParallelTrainer(model=tiny_model("llama", 4, 2, vocab_size=64, seed=0), args=args("sp"),
                                 train_dataset=datasets.Dataset.from_list(bad[:1] + good[:2] + bad[1:] + good[2:]),
                                 max_length=16)
    sp.train()
    assert "dropped 2 rows with no supervised token" in capsys.readouterr().out
    plain = Trainer(model=tiny_model("llama", 4, 2, vocab_size=64, seed=0), args=args("plain"),
                    train_dataset=datasets.Dataset.from_list(good), data_collator=pad_collate)
    plain.train()
    a = [h["loss"] for h in sp.state.log_history if "loss" in h]
    b = [h["loss"] for h in plain.state.log_history if "loss" in h]
    print("hf trainer losses", a, b)
    assert len(a) == len(b) == 2 and min(a) > 1.0
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5


# ----------------------------------------------------------------------------- lock, resume, guard, CLI
def test_output_dir_lock(tmp_path):
    """Refuses a live owner, replaces a stale one, shares with its own run, releases (also on error)."""
    from seqpar.errors import SeqParError
    from seqpar.train.lifecycle.lock import LOCK_NAME, OutputDirLock

    path = tmp_path / LOCK_NAME
    with OutputDirLock(tmp_path, run_id="a", pid=os.getpid()):
        info = json.loads(path.read_text())
        assert info["pid"] == os.getpid() and info["run_id"] == "a" and info["host"] and info["started"]
        with pytest.raises(SeqParError, match="in use by another seqpar run.*pid"):
            OutputDirLock(tmp_path, run_id="b").acquire()
        same = OutputDirLock(tmp_path, run_id="a")
        same.acquire()  # the launcher's lock, seen by its rank 0
        same.release()
        assert path.exists()  # only the owner removes it
    assert not path.exists()
    dead = run_command([sys.executable, "-c", "import os; print(os.getpid())"], timeout=60)
    # A lock left by a run whose processes have all exited (written as it would have: no one holds the file).
    path.write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "run_id": "old"}))
    with pytest.raises(RuntimeError):
        with OutputDirLock(tmp_path, run_id="new", pid=os.getpid()):
            assert json.loads(path.read_text())["run_id"] == "new"
            raise RuntimeError("boom")
    assert not path.exists()
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(SeqParError, match="not writable"):
            OutputDirLock(tmp_path / "ro").acquire()


def test_nonfinite_steps_skipped_then_stop(data, tmp_path):
    """lr 1e4: non-finite steps update nothing (same rows -> bit-identical loss), are counted in
    metrics.jsonl, and max_consecutive_nonfinite of them stop the run with TrainingDiverged."""
    from seqpar.errors import TrainingDiverged
    from seqpar.train.lifecycle.lock import LOCK_NAME

    same = tmp_path / "same.jsonl"
    same.write_text("".join(json.dumps({"instruction": "alpha beta", "response": "gamma delta"}) + "\n"
                            for _ in range(4)))
    cfg = _cfg(data, tmp_path / "nan", max_steps=20, optimizer={"lr": 1e4}, max_consecutive_nonfinite=3,
               checkpoint={"every": 0}, dataset={"path": str(same), "max_length": 64})
    with pytest.raises(TrainingDiverged, match="3 consecutive steps"):
        _train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    flags = [r["nonfinite"] for r in rows]
    assert flags[0] == 0 and flags[-3:] == [1, 1, 1] and len(rows) < 20, flags
    skipped = [r for r in rows if r["nonfinite"]]
    # No update after a skipped step: the next step (same rows) sees the same parameters.
    assert len({r["loss"] for r in skipped[1:]}) == 1
    assert not (tmp_path / "nan" / LOCK_NAME).exists()  # released on the error
    assert not (tmp_path / "nan" / "final").exists()


def _write_yaml(tmp_path, name, cfg):
    import yaml

    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def _one_error(r, pattern):
    err = r.stderr
    assert "Traceback" not in err and "torch.distributed.elastic" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("seqpar: ")]
    assert len(lines) == 1 and pattern in err, err[-3000:]


def test_cli_errors_before_launch(data, tmp_path):
    """`seqpar train --nproc-per-node 2` refuses bad data / model limits / a held lock in the launcher:
    exit 2, one message, no rank started; `seqpar check` refuses what train refuses (a non-causal model)."""
    from transformers import BertConfig

    from seqpar.train.lifecycle.lock import OutputDirLock

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"text": \n')
    held = tmp_path / "held"
    OutputDirLock(held, run_id="other", pid=os.getppid()).acquire()  # a live process "owns" it
    bert = tmp_path / "bert"
    BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(bert)
    cases = [
        ("broken", {"dataset": {"path": str(broken), "max_length": 64}}, "broken.jsonl:"),  # file:line
        ("held", {"output_dir": str(held)}, "in use by another seqpar run"),
    ]
    for name, over, pattern in cases:
        cfg = _cfg(data, tmp_path / name, sequence_parallel={"size": 2})
        cfg.update({k: v for k, v in over.items() if k != "output_dir"})
        cfg["output_dir"] = over.get("output_dir", str(tmp_path / name))
        r = _seqpar("train", _write_yaml(tmp_path, name, cfg), "--nproc-per-node", "2")
        assert r.returncode == 2, (name, r.stderr[-2000:])
        _one_error(r, pattern)
        assert not (tmp_path / name / "metrics.jsonl").exists()
    cfg = _cfg(data, tmp_path / "bert_out", model={"name": str(bert)})
    r = _seqpar("check", _write_yaml(tmp_path, "bert", cfg))
    assert r.returncode == 2, r.stderr[-2000:]
    _one_error(r, "non-causal")


def test_model_checks(data, tmp_path):
    """What `check` / the launcher / `train` refuse from the model's config: token ids >= vocab,
    max_length > max_position_embeddings, non-causal attention."""
    from transformers import BertConfig

    from seqpar.errors import SeqParError
    from seqpar.train.config import config_from_dict
    from seqpar.train.model.checks import check_model

    ok = [{"input_ids": [1, 2, 258], "labels": [1, 2, 258]}]
    check_model(config_from_dict(_cfg(data, tmp_path)), ok)
    with pytest.raises(SeqParError, match="token id 999 .* 259 ids"):
        check_model(config_from_dict(_cfg(data, tmp_path)), [[{"input_ids": [1, 999]}]])  # a pack
    small = _cfg(data, tmp_path, model={"name": "tiny:llama", "kwargs": {"max_position_embeddings": 32}})
    with pytest.raises(SeqParError, match="max_length=64 exceeds the model's max_position_embeddings=32"):
        check_model(config_from_dict(small), ok)
    BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(tmp_path / "bert")
    with pytest.raises(SeqParError, match="non-causal attention"):
        check_model(config_from_dict(_cfg(data, tmp_path, model={"name": str(tmp_path / "bert")})), ok)


def test_resume_rules(data, tmp_path, monkeypatch):
    """find_resume: same run -> (checkpoint, step); a changed key -> SeqParError naming it; more max_steps,
    other checkpoint settings and another layout (world, SP, dp, FSDP2, micro-batch / grad-accum) are fine;
    resume: false -> fresh. plan_resume says what a layout / global-batch change does, and refuses a dataset
    of another size (the data position is a row count; other data changes: test_resume_data.py)."""
    import seqpar.train.lifecycle.resume as resume
    from seqpar.errors import SeqParError

    monkeypatch.setattr(resume, "checkpoint_damage", lambda ckpt: None)  # a stand-in checkpoint: no real files
    from seqpar.train.config import config_from_dict
    from seqpar.train.dataset.identity import DataIdentity, resolved_path
    from seqpar.train.lifecycle.resume import find_resume, plan_resume, run_meta
    from seqpar.train.lifecycle.run_layout import RunLayout

    six = DataIdentity(6, resolved_path(str(data / "sft.jsonl")), "files", "examples")  # stand-in hashes

    base = _cfg(data, tmp_path, sequence_parallel={"size": 2})
    ck = tmp_path / "checkpoint-4"
    ck.mkdir()
    saved = RunLayout.of(config_from_dict(base), 2, 2, 1)  # world 2: dp 1 x sp 2 (ulysses 2), 2 examples per step
    (ck / "run.json").write_text(json.dumps(run_meta(config_from_dict(base), 2, saved, rows=8, data=six)))
    for name in (".metadata", "trainer_state_rank0.pt"):  # what a finished save leaves
        (ck / name).write_text("")
    (tmp_path / "latest").write_text("checkpoint-4")
    assert find_resume(config_from_dict(base)) == (ck, 4)
    assert find_resume(config_from_dict(dict(base, max_steps=9, checkpoint={"every": 3}))) == (ck, 4)
    assert find_resume(config_from_dict(dict(base, checkpoint={"resume": False}))) is None
    for over in ({"sequence_parallel": {"size": 4, "ring_degree": 2}}, {"grad_accum": 2}, {"fsdp": True},
                 {"micro_batch_size": 1, "global_batch_size": 4}):
        assert find_resume(config_from_dict(dict(base, **over))) == (ck, 4), over
    changed = [({"optimizer": {"lr": 0.5}}, "optimizer.lr: 0.01 -> 0.5"),
               ({"finetuning": LORA}, "finetuning.method: 'full' -> 'lora'"),
               ({"seed": 1}, "seed: 0 -> 1"),
               ({"dataset": {"path": str(data / "sft.jsonl"), "max_length": 32}}, "dataset.max_length: 64 -> 32")]
    for over, msg in changed:
        with pytest.raises(SeqParError, match="cannot resume from .*checkpoint-4 .step 4.") as e:
            find_resume(config_from_dict(dict(base, **over)))
        assert msg in str(e.value) and "checkpoint.resume: false" in str(e.value), str(e.value)
    # The same layout: nothing to say. World 4 at dp 2 x sp 2 (ring 2), micro-batch 1: the global batch is kept.
    cfg = config_from_dict(base)
    assert plan_resume(cfg, saved, six).lines == () and plan_resume(cfg, saved, six).rows == 8
    moved = config_from_dict(dict(base, micro_batch_size=1, fsdp=True))
    plan = plan_resume(moved, RunLayout.of(moved, 4, 1, 2), six)
    assert (plan.step, plan.rows, plan.saved) == (4, 8, saved)
    text = "\n".join(plan.lines)
    assert "world 2 (dp 1 x sp 2: ulysses 2 x ring 1), this run is world 4 (dp 2 x sp 2: ulysses 1 x ring 2, " \
           "FSDP2)" in text and "rank 0's saved torch RNG" in text, text
    assert "global batch kept: 2 examples per step (dp 1 x micro_batch_size 2 x grad_accum 1 -> dp 2 x " \
           "micro_batch_size 1 x grad_accum 1); the data continues at row 8 (epoch 1: 2 of its 6 examples done)" \
           in text, text
    # Another global batch: what changes, and how to keep the old one.
    bigger = config_from_dict(dict(base, grad_accum=3))
    text = "\n".join(plan_resume(bigger, RunLayout.of(bigger, 2, 2, 1), six).lines)
    assert "global batch 2 -> 6 examples per step" in text and "steps per epoch 3 -> 1" in text, text
    assert "the data continues at row 8" in text and "global_batch_size: 2" in text, text
    seven = DataIdentity(7, six.path, "other files", "other examples")
    with pytest.raises(SeqParError, match="content sha256 files -> other files.* .6 -> 7 examples.") as e:
        plan_resume(cfg, saved, seven)
    assert "its data is not this run's: the dataset file(s) at " in str(e.value), str(e.value)
    # A checkpoint from before the data's identity was recorded: its size is what can be compared.
    (ck / "run.json").write_text(json.dumps({k: v for k, v in json.loads((ck / "run.json").read_text()).items()
                                             if k != "data"}))
    assert plan_resume(cfg, saved, DataIdentity(6, six.path, "a", "b")).rows == 8
    with pytest.raises(SeqParError, match="its run had 6 examples and this dataset gives 7"):
        plan_resume(cfg, saved, seven)


@pytest.mark.slow
def test_cli_resume_rules(data, tmp_path):
    """A resume announces itself; a changed lr is refused before launch naming the key; more max_steps continue,
    also on another world size (one process, SP 1: announced), and back on two."""
    cfg = _cfg(data, tmp_path / "run", sequence_parallel={"size": 2}, max_steps=3,
               export={"final": False}, checkpoint={"every": 1})
    y = _write_yaml(tmp_path, "run", cfg)
    r = _seqpar("train", y, "--nproc-per-node", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _seqpar("train", y, "--nproc-per-node", "2", "--set", "optimizer.lr=0.02")
    assert r.returncode == 2
    _one_error(r, "optimizer.lr: 0.01 -> 0.02")
    assert "checkpoint.resume: false" in r.stderr
    r = _seqpar("train", y, "--set", "sequence_parallel.size=1", "--max-steps", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[seqpar] resuming from step 3: {tmp_path / 'run' / 'checkpoint-3'}" in r.stdout  # the last step's
    assert "this run is world 1 (dp 1 x sp 1)" in r.stdout, r.stdout
    r = _seqpar("train", y, "--nproc-per-node", "2", "--max-steps", "5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 4" in r.stdout and "this run is world 2 (dp 1 x sp 2" in r.stdout, r.stdout
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_cli_ctrl_c_one_line(data, tmp_path):
    """SIGINT to `seqpar train --nproc-per-node 2` after the first checkpoint: every rank stops, exit 130,
    one line naming the last checkpoint, no traceback; the lock is released."""
    import signal
    import time

    from seqpar.train.lifecycle.lock import LOCK_NAME

    out = tmp_path / "int"
    cfg = _cfg(data, out, sequence_parallel={"size": 2}, max_steps=100000, checkpoint={"every": 1})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The run would go on for hours: `spawned` kills it (and its ranks) however this test ends.
    with spawned([sys.executable, "-m", "seqpar", "train", _write_yaml(tmp_path, "int", cfg), "--nproc-per-node", "2"],
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        deadline = time.time() + 300
        while not (out / "latest").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert (out / "latest").exists(), f"no checkpoint after {time.time() - deadline + 300:.0f} s"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = communicate(proc, timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    # Everything but progress bars (datasets' "Generating train split", DCP's "Writing model shards") and the
    # run's start lines (its configuration, the attention kernel it chose).
    lines = [ln for ln in (stdout + stderr).splitlines() if ln.strip() and "it/s]" not in ln and "s/s]" not in ln
             and not ln.startswith(("[seqpar] sft fp32: ", "[seqpar] attention kernel: "))]
    assert len(lines) == 1 and lines[0].startswith("seqpar: interrupted; last checkpoint: "), "\n".join(lines)
    assert (out / lines[0].rsplit(": ", 1)[1].split("/")[-1]).is_dir()
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_cli_rank_failure_reported_once(data, tmp_path):
    """After launch: a diverged run (lr 1e4) prints one 'stopped' line and exits 1; a rank that dies
    without a Python error (test fault hook) is named once with its exit code."""
    cfg = _cfg(data, tmp_path / "nan", sequence_parallel={"size": 2}, max_steps=20, optimizer={"lr": 1e4},
               checkpoint={"every": 0})
    r = _seqpar("train", _write_yaml(tmp_path, "nan", cfg), "--nproc-per-node", "2")
    assert r.returncode == 1, r.stderr[-3000:]
    _one_error(r, "consecutive steps")
    cfg = _cfg(data, tmp_path / "fault", sequence_parallel={"size": 2}, max_steps=4, checkpoint={"every": 0})
    env = dict(os.environ, OMP_NUM_THREADS="1", SEQPAR_FAULT_AFTER_STEP="2", SEQPAR_FAULT_RANK="1")
    r = run_command([sys.executable, "-m", "seqpar", "train", _write_yaml(tmp_path, "fault", cfg), "--nproc-per-node",
                     "2"], env=env, timeout=300)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("rank 1: exit code 13") == 1, r.stderr[-3000:]


def test_smollm2_adapter_names_the_hub_base(tmp_path):
    """A LoRA adapter exported from a SmolLM2 run points at the hub model, not into this machine's cache."""
    from seqpar.hf import tiny_model
    from seqpar.train.config import config_from_dict
    from seqpar.train.lifecycle.export import SMOLLM2_HUB_ID, _write
    from seqpar.train.model.load import apply_lora
    from seqpar.train.model.tokenizers import ByteTokenizer

    cfg = config_from_dict({"model": {"name": "smollm2"}, "dataset": {"path": "unused.jsonl", "max_length": 64},
                            "finetuning": LORA, "output_dir": str(tmp_path)})
    model = apply_lora(tiny_model("llama", 4, 2, vocab_size=300, seed=0), cfg)  # a stand-in with the same wrapper
    out = _write(model, cfg, ByteTokenizer(), tmp_path / "final", False, 1, "test")  # the writer, no SmolLM2 load
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == SMOLLM2_HUB_ID
    assert json.loads((out / "seqpar_export.json").read_text())["base"].startswith(SMOLLM2_HUB_ID)
