"""Bad input is one `seqpar: error:` line naming the fix, exit code 2, before anything is launched (in-process CLI,
no process group): files that are not UTF-8 or not JSON, counts of 0 or below that used to slip through an `or`,
a --set value that is not YAML. Also: a damaged run record or `latest` marker, a metrics row cut short, and the
launcher's one line for a rank error whose message spans many lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from procs import write_sft_rows

from seqpar.cli.main import main
from seqpar.errors import SeqParError

BINARY = bytes(range(256)) * 4  # 0x80 at offset 128: not UTF-8


def _config(tmp_path: Path, **over) -> Path:
    write_sft_rows(tmp_path)
    cfg = {"model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 1}},
           "dataset": {"path": str(tmp_path / "sft.jsonl"), "max_length": 64}, "max_steps": 2,
           "output_dir": str(tmp_path / "run"), "progress": False}
    cfg.update(over)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _one_line(capsys, argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("seqpar: error: "), (code, err)
    for n in needles:
        assert n in err, err
    return err


def test_files_that_are_not_utf8_or_not_json(tmp_path, capsys):
    """A binary dataset (the issue's case: a 32-line UnicodeDecodeError, exit 1), eval dataset, config file,
    chat template file and planner model config; an invalid planner config.json; a --set value that is not YAML."""
    cfg = _config(tmp_path)
    (tmp_path / "bin.jsonl").write_bytes(BINARY)
    _one_line(capsys, ["check", str(cfg), "--set", f"dataset.path={tmp_path / 'bin.jsonl'}"],
              f"dataset: {tmp_path / 'bin.jsonl'}: not UTF-8 text (byte 0x80 at offset 128, line 2)")
    _one_line(capsys, ["check", str(cfg), "--set", f"eval_dataset={tmp_path / 'bin.jsonl'}"],
              "eval_dataset: ", "not UTF-8 text")
    (tmp_path / "bin.yaml").write_bytes(b"model: tiny:llama\n" + BINARY)
    _one_line(capsys, ["check", str(tmp_path / "bin.yaml")], f"config file {tmp_path / 'bin.yaml'}: not UTF-8")
    _one_line(capsys, ["check", str(cfg), "--set", "max_steps=[1"], "--set 'max_steps=[1'", "not valid YAML")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_bytes(BINARY)
    _one_line(capsys, ["plan", "--model", str(tmp_path / "model"), "--seq-len", "1024"], "not UTF-8 text")
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 64,\n')
    _one_line(capsys, ["plan", "--model", str(tmp_path / "model"), "--seq-len", "1024"],
              "config.json:2:1: invalid JSON")
    from seqpar.train.model.tokenizers import load_chat_template

    (tmp_path / "t.jinja").write_bytes(BINARY)
    with pytest.raises(SeqParError, match="dataset.chat_template file .*: not UTF-8 text"):
        load_chat_template(str(tmp_path / "t.jinja"))


@pytest.mark.parametrize("argv, needle", [
    (["check", "{cfg}", "--nproc-per-node", "0"], "--nproc-per-node 0: give a whole number >= 1"),
    (["check", "{cfg}", "--nproc-per-node", "-2"], "--nproc-per-node -2"),  # was: "OK ... world=-2"
    (["verify", "{cfg}", "--nproc-per-node", "0"], "--nproc-per-node 0"),  # was: the config's SP size
    (["verify", "{cfg}", "--steps", "0"], "--steps 0"),
    (["verify", "{cfg}", "--tolerance", "-1"], "--tolerance -1.0"),  # was: a run that always FAILs
    (["verify", "{cfg}", "--tolerance", "nan"], "--tolerance nan"),
    (["train", "{cfg}", "--max-steps", "0"], "--max-steps 0"),
    (["train", "{cfg}", "--nproc-per-node", "2", "--max-restarts", "-1"], "--max-restarts -1"),  # was: torch's assert
    (["train", "{cfg}", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "-1"], "--node-rank -1"),
    (["train", "{cfg}", "--nproc-per-node", "2", "--nnodes", "0"], "--nnodes 0"),
    (["train", "{cfg}", "--nproc-per-node", "2", "--nnodes", "2:1"], "--nnodes '2:1'"),
    (["plan", "--model", "llama-3.1-8b", "--seq-len", "8192", "--gpus-per-node", "0"], "--gpus-per-node"),
    (["plan", "--model", "llama-3.1-8b", "--seq-len", "0"], "--seq-len must be a number of tokens >= 1"),
    (["plan", "--model", "llama-3.1-8b", "--seq-len", "8192", "--top", "-1"], "--top must be >= 1"),
])
def test_counts_below_their_least_value(tmp_path, capsys, argv, needle):
    cfg = _config(tmp_path)
    _one_line(capsys, [str(cfg) if a == "{cfg}" else a for a in argv], needle)


def test_damaged_run_records(tmp_path, capsys):
    """A checkpoint's run.json that is not JSON (a save cut short) is one line for resume and export; a `latest`
    marker of garbage bytes falls back to the newest complete checkpoint (a line says so); a metrics row cut short
    is dropped on resume with a line."""
    from seqpar.train.config import load_config
    from seqpar.train.run import train

    cfg = _config(tmp_path, checkpoint={"every": 1, "keep_last": 2})
    out = tmp_path / "run"
    train(load_config(cfg))
    (out / "latest").write_bytes(b"\xff\xfe\x00garbage")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')
    capsys.readouterr()
    res = train(load_config(cfg, {"max_steps": 3}))
    said = capsys.readouterr().out
    assert res.resumed_from == 2 and res.steps == [3], (res.resumed_from, res.steps)
    assert "resuming from the newest intact checkpoint" in said and "dropped 1 unreadable row(s)" in said, said
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    (out / "checkpoint-3" / "run.json").write_bytes(BINARY)
    with pytest.raises(SeqParError, match="checkpoint record .*run.json: not UTF-8 text"):
        train(load_config(cfg, {"max_steps": 4}))
    (out / "checkpoint-3" / "run.json").write_text('{"config": {"model": ')
    _one_line(capsys, ["export", str(out / "checkpoint-3"), str(tmp_path / "exp")], "run.json:1:", "invalid JSON")


def test_launcher_prints_one_line_of_a_long_rank_error(tmp_path, capsys):
    """A rank error whose message spans many lines (DCP's CheckpointException holds every rank's traceback): the
    launcher prints its first line and the traceback file, not the whole message."""
    from types import SimpleNamespace

    from seqpar.train.lifecycle.launch import _report_failure

    message = "CheckpointException ranks:dict_keys([0, 1])\n" + "Traceback line\n" * 80
    rec = {"rank": 1, "attempt": 0, "time": 1.0, "type": "CheckpointException", "message": message, "code": 1,
           "traceback": "Traceback ...\n"}
    (tmp_path / "attempt0_rank1.json").write_text(json.dumps(rec))
    code = _report_failure(SimpleNamespace(failures={1: None}), tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 2, err
    assert err[0].startswith("seqpar: error on rank 1: CheckpointException: CheckpointException ranks:"), err
    assert "(+80 more lines in the traceback file)" in err[0] and err[1].startswith("seqpar: its traceback: "), err


def test_demo_counts(tmp_path, capsys):
    """`python -m seqpar.demo --nproc 0` (a config validation traceback before): one line, exit 2."""
    from seqpar.demo import main as demo

    assert demo(["--nproc", "0", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "seqpar demo: error: --nproc 0: give a whole number >= 1", err


def _rows(tmp_path: Path, name: str, rows: list) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


UNSUPERVISED = [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}]
CHAT = [{"messages": [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "x"}]}]


@pytest.mark.parametrize("name,rows,over,needles", [
    # all labels -100: the fix named depends on the format and on train_on_prompt (it was always train_on_prompt)
    ("unsup.jsonl", UNSUPERVISED, {"train_on_prompt": True},
     ["tokenized rows keep their labels as given (dataset.train_on_prompt does not change them)"]),
    ("unsup.jsonl", UNSUPERVISED, {}, ["leave the labels column out to supervise every token"]),
    ("one.jsonl", [{"text": ""}], {"train_on_prompt": True},
     ["dataset.train_on_prompt is already on", "every row is at most one token long"]),
    # tracebacks before: ValueError (int('a')), TypeError (str + int, iterating an int); a negative id was accepted
    ("ids.jsonl", [{"input_ids": ["a", "b"]}], {}, ["row 1: input_ids must be a list of integers, token ids >= 0"]),
    ("neg.jsonl", [{"input_ids": [1, -5, 3]}], {}, ["input_ids must be a list of integers", "got -5"]),
    ("lab.jsonl", [{"input_ids": [1, 2], "labels": [1, -1]}], {}, ["labels must be", "-100 (not supervised); got -1"]),
    ("dpo.jsonl", [{"prompt": "a", "chosen": 1, "rejected": "b"}], {"stage": "dpo"},
     ["row 1: 'chosen' must be text or a list of chat messages, got int"]),
    ("img.jsonl", [{**CHAT[0], "images": 5}], {"model": {"name": "tiny:qwen2_5_vl"}},
     ["row 1: 'images' must be a list of local files (or one), got int 5"]),
])
def test_bad_rows_one_line(tmp_path, capsys, name, rows, over, needles):
    path = _rows(tmp_path, name, rows)
    cfg = _config(tmp_path, **{k: v for k, v in over.items() if k != "train_on_prompt"})
    data = yaml.safe_load(cfg.read_text())
    data["dataset"] = {"path": path, "max_length": 64, **({"train_on_prompt": True} if "train_on_prompt" in over
                                                          else {})}
    cfg.write_text(yaml.safe_dump(data))
    _one_line(capsys, ["check", str(cfg)], *needles)


@pytest.mark.parametrize("kwargs,needle", [
    ({"num_heads": 0}, "do not make a tiny llama config (ZeroDivisionError"),
    ({"num_heads": "four"}, "do not make a tiny llama config"),
    ({"vocab_size": "big"}, "set model.kwargs.vocab_size >= 259"),
    ({"seed": "x"}, "model.kwargs.seed='x': give an integer"),
    ({"dtype": "foo"}, "model.kwargs.dtype='foo': use one of float32, float64, bfloat16, float16"),
    # config classes keep any keyword as an attribute: a misspelt key would change nothing, silently
    ({"num_hiden_layers": 3}, "'num_hiden_layers' is not a setting of LlamaConfig: did you mean 'num_hidden_layers'?"),
])
def test_bad_tiny_model_kwargs_one_line(tmp_path, capsys, kwargs, needle):
    """Tiny-model kwargs transformers' config classes reject (each was a traceback) are one line before launch."""
    cfg = _config(tmp_path, model={"name": "tiny:llama", "kwargs": kwargs})
    _one_line(capsys, ["check", str(cfg)], "model.kwargs", needle)


def test_bad_tiny_attn_implementation_one_line(tmp_path, capsys):
    """model.kwargs.attn_implementation reaches transformers only when the weights are built: one line from train."""
    cfg = _config(tmp_path, model={"name": "tiny:llama", "kwargs": {"attn_implementation": "nope"}})
    _one_line(capsys, ["train", str(cfg)], "model.kwargs {'attn_implementation': 'nope'}: the tiny model cannot be "
              "built (Specified `attn_implementation=\"nope\"` is not supported")


@pytest.mark.parametrize("arch,cls", [("qwen3_5", "Qwen3_5TextConfig"), ("qwen3_vl", "Qwen3VLTextConfig")])
def test_tiny_config_refuses_unknown_keys(arch, cls):
    """The library's tiny_config too (hybrid, and a VLM's text config); keys transformers converts still pass."""
    from seqpar.hf import tiny_config

    with pytest.raises(SeqParError, match=f"'linear_num_key_head' is not a setting of {cls}: did you mean"):
        tiny_config(arch, linear_num_key_head=2)
    assert tiny_config(arch, rope_theta=5e5) is not None


def test_attention_spans_and_sinks_it_cannot_read(tmp_path, capsys):
    """A sliding window that is not a positive whole number, a chunk size below 1: one line from `seqpar check`,
    `seqpar train` (before any rank starts) and `seqpar plan`. Sinks that are not one logit per q head: refused by
    name (read from the attention modules)."""
    import torch

    from seqpar.train.model.checks import refuse_bad_sinks

    def tiny_mistral(**kw) -> dict:
        return {"model": {"name": "tiny:mistral", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 1,
                                                            "max_position_embeddings": 4096, **kw}}}

    zero = _config(tmp_path, **tiny_mistral(sliding_window=0))
    _one_line(capsys, ["check", str(zero)], "config.sliding_window=0 is not a positive whole number of tokens")
    _one_line(capsys, ["train", str(zero), "--nproc-per-node", "2"], "config.sliding_window=0")
    # a window wider than the positions never masks a key (Phi-3-mini-128k's published config): accepted
    wide = _config(tmp_path, **tiny_mistral(sliding_window=8192))
    capsys.readouterr()
    assert main(["check", str(wide)]) == 0
    llama4 = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 512, "num_local_experts": 1, "max_position_embeddings": 4096}
    for chunk in (0, -8):
        (tmp_path / "llama4.json").write_text(json.dumps({**llama4, "attention_chunk_size": chunk}))
        _one_line(capsys, ["plan", "--model", str(tmp_path / "llama4.json"), "--seq-len", "1024"],
                  f"config.attention_chunk_size={chunk} is not a positive whole number")
    attn = torch.nn.Module()
    attn.sinks = torch.nn.Parameter(torch.zeros(2, 4))
    model = torch.nn.ModuleDict({"self_attn": attn})
    with pytest.raises(SeqParError, match=r"self_attn.sinks has shape \[2, 4\].*\[num_attention_heads\] = \[4\]"):
        refuse_bad_sinks(model, 4, "m")
    attn.sinks = torch.nn.Parameter(torch.zeros(4))
    refuse_bad_sinks(model, 4, "m")  # one logit per q head: read as it is
