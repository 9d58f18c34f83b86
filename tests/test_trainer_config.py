"""Config validation, dataset formats and packing: no process group, no spawn (fast)."""

from __future__ import annotations

import json
import sys
import time

import pytest
from procs import run_command

from seqpar import SeqParError
from seqpar.train.config import config_from_dict, load_config, validate_for_launch
from seqpar.train.dataset.tokenize import IGNORE, build_examples, load_rows, pack_rows, tokenize_sft
from seqpar.train.model.tokenizers import ByteTokenizer

TINY = {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2}}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def sft_file(tmp_path):
    rows = [{"instruction": f"q{i} " * 3, "response": f"a{i} " * 4} for i in range(6)]
    return _write_jsonl(tmp_path / "sft.jsonl", rows)


def _cfg(path, **kw):
    d = {"model": TINY, "dataset": {"path": str(path), "max_length": 64}}
    d.update(kw)
    return config_from_dict(d)


def _err(fn, *needles):
    with pytest.raises(SeqParError) as e:
        fn()
    for n in needles:
        assert n in str(e.value), str(e.value)
    return str(e.value)


def test_sp_must_divide_world(sft_file):
    cfg = _cfg(sft_file, sequence_parallel=4)
    _err(lambda: validate_for_launch(cfg, 6, num_heads=4, num_kv_heads=2), "does not divide the world size 6",
         "1, 2, 3, 6")


def test_degrees_must_multiply_to_size(sft_file):
    _err(lambda: _cfg(sft_file, sequence_parallel={"size": 4, "ulysses_degree": 2, "ring_degree": 1}),
         "ulysses_degree=2 x ring_degree=1", "size: 2")
    _err(lambda: _cfg(sft_file, sequence_parallel={"size": 4, "ulysses_degree": 3}), "must divide size=4", "1, 2, 4")


def test_auto_degrees_from_heads_and_max_length_multiple(sft_file):
    # 4 q / 2 kv heads, sp=4 -> ulysses 2 x ring 2, zigzag: lengths must be multiples of 2*2*2 = 8.
    cfg = _cfg(sft_file, sequence_parallel=4, dataset={"path": str(sft_file), "max_length": 60})
    msg = _err(lambda: validate_for_launch(cfg, 4, num_heads=4, num_kv_heads=2), "multiple of 8", "56 or 64")
    assert "ulysses=2, ring=2" in msg
    cfg = _cfg(sft_file, sequence_parallel=4, dataset={"path": str(sft_file), "max_length": 64})
    assert validate_for_launch(cfg, 8, num_heads=4, num_kv_heads=2) == (2, 2)


def test_unknown_key_and_missing_field(sft_file):
    _err(lambda: _cfg(sft_file, max_step=3), "max_step", "unknown key")
    _err(lambda: config_from_dict({"model": "tiny:llama"}), "dataset", "required")
    _err(lambda: _cfg(sft_file, stage="dpo", dataset={"path": str(sft_file), "max_length": 64, "packing": True}),
         "packing: false")


def test_unknown_model_fails_fast(sft_file, tmp_path):
    from seqpar.train.model.load import model_heads

    _err(lambda: model_heads(_cfg(sft_file, model="tiny:gpt9")), "unknown tiny architecture", "tiny:<llama")
    _err(lambda: model_heads(_cfg(sft_file, model=str(tmp_path / "no-such-model"))), "no such directory", "smollm2")
    _err(lambda: model_heads(_cfg(sft_file, model="no-such-org/no-such-model")), "could not be loaded", "smollm2")


def test_dataset_field_errors(tmp_path):
    tok = ByteTokenizer()
    dpo = _write_jsonl(tmp_path / "dpo.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"},
                                               {"prompt": "p", "chosen": "c", "rejected": None}])
    _err(lambda: build_examples(load_rows(str(dpo)), "auto", "dpo", tok, 64, False), "row 2 ", "rejected")  # line 2
    _err(lambda: build_examples(load_rows(str(dpo)), "auto", "sft", tok, 64, False), "stage: dpo")
    txt = _write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}])
    _err(lambda: build_examples(load_rows(str(txt)), "auto", "dpo", tok, 64, False), "prompt, chosen and rejected")
    _err(lambda: build_examples(load_rows(str(txt)), "chat", "sft", tok, 64, False), "'messages'")
    _err(lambda: load_rows(str(tmp_path / "missing.jsonl")), "does not exist")


def test_max_length_unreachable(tmp_path):
    tok = ByteTokenizer()
    f = _write_jsonl(tmp_path / "i.jsonl", [{"instruction": "x" * 80, "response": "y"}])
    _err(lambda: build_examples(load_rows(str(f)), "auto", "sft", tok, 64, False), "raise dataset.max_length above")
    d = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 80, "chosen": "a", "rejected": "b"}])
    _err(lambda: build_examples(load_rows(str(d)), "auto", "dpo", tok, 64, False), "prompt alone",
         "raise dataset.max_length")


def test_formats_supervise_only_responses(tmp_path):
    tok = ByteTokenizer()
    ins = tokenize_sft({"instruction": "hi", "response": "yo"}, "instruction", tok)
    sup = [t for t, lab in zip(ins["input_ids"], ins["labels"]) if lab != IGNORE]
    assert sup == tok.encode("yo") + [tok.eos_token_id]
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    ex = tokenize_sft(chat, "chat", tok)
    assert ex["input_ids"] == tok.chat(chat["messages"], add_generation_prompt=False)
    sup = [t for t, lab in zip(ex["input_ids"], ex["labels"]) if lab != IGNORE]
    assert sup == tok.encode("b") + [tok.eos_token_id] + tok.encode("d") + [tok.eos_token_id]
    txt = tokenize_sft({"text": "abc"}, "text", tok)
    assert txt["labels"] == txt["input_ids"] == tok.encode("abc") + [tok.eos_token_id]


def test_packing_is_greedy_and_bounded():
    rows = [{"input_ids": [1] * n, "labels": [1] * n} for n in (30, 30, 10, 50, 64, 5)]
    packs = pack_rows(rows, 64)
    assert [[len(r["input_ids"]) for r in p] for p in packs] == [[30, 30], [10, 50], [64], [5]]


def test_load_config_relative_path_and_overrides(tmp_path, sft_file):
    p = tmp_path / "cfg.yaml"
    p.write_text("model: tiny:llama\ndataset: {path: sft.jsonl, max_length: 64}\nsequence_parallel: 2\n")
    cfg = load_config(p, {"max_steps": 3, "sequence_parallel.ring_degree": 2})
    assert cfg.dataset.path == str(sft_file) and cfg.max_steps == 3
    assert cfg.sequence_parallel.size == 2 and cfg.sequence_parallel.ring_degree == 2


def test_global_batch_size_and_grad_accum_not_both(tmp_path, sft_file):
    """Both set in one place: refused (grad_accum would be replaced silently). On the command line one replaces the
    file's other, as --max-steps replaces num_epochs. A dump (config.json, run.json, verify's configs) of a config
    with global_batch_size leaves the derived grad_accum out, so it loads again."""
    _err(lambda: _cfg(sft_file, global_batch_size=4, grad_accum=2), "set global_batch_size or grad_accum, not both",
         "grad_accum=2 would not be used")
    y = tmp_path / "c.yaml"
    y.write_text(f"model: tiny:llama\ndataset: {{path: {sft_file}, max_length: 64}}\nglobal_batch_size: 4\n")
    assert load_config(y, {"grad_accum": 2}).global_batch_size is None
    y.write_text(f"model: tiny:llama\ndataset: {{path: {sft_file}, max_length: 64}}\ngrad_accum: 2\n")
    cfg = load_config(y, {"global_batch_size": 4})
    assert (cfg.global_batch_size, "grad_accum" in cfg.model_fields_set) == (4, False)
    _err(lambda: load_config(y, {"global_batch_size": 4, "grad_accum": 2}), "not both")
    from seqpar.train.config import resolve_grad_accum

    resolved = resolve_grad_accum(cfg, 2)  # dp 2, micro_batch_size 1: grad_accum 2
    assert resolved.grad_accum == 2 and "grad_accum" not in resolved.model_dump(mode="json")
    assert config_from_dict(json.loads(resolved.model_dump_json())).global_batch_size == 4


def test_cli_bad_config_fails_before_spawning(tmp_path, sft_file):
    """`seqpar train --nproc-per-node 3` with sp=2: exit 2, the fix named, no torchrun started."""
    p = tmp_path / "cfg.yaml"
    p.write_text(f"model: tiny:llama\ndataset: {{path: {sft_file}, max_length: 64}}\nsequence_parallel: 2\n")
    t0 = time.time()
    r = run_command([sys.executable, "-m", "seqpar", "train", str(p), "--nproc-per-node", "3"], timeout=120)
    assert r.returncode == 2, r.stderr
    assert "does not divide the world size 3" in r.stderr and "1, 3" in r.stderr
    assert "torch.distributed" not in r.stderr and time.time() - t0 < 120


def test_cli_check_in_process(tmp_path, sft_file, capsys):
    from seqpar.cli.main import main

    p = tmp_path / "cfg.yaml"
    ds = f"{{path: {sft_file}, max_length: 256, packing: true}}"
    p.write_text(f"model: tiny:llama\ndataset: {ds}\nsequence_parallel: 4\n")
    assert main(["check", str(p), "--nproc-per-node", "8"]) == 0
    assert "OK: 2 training examples from 6 rows" in capsys.readouterr().out  # ~43-token rows: packs of 5 + 1
    assert main(["check", str(p), "--nproc-per-node", "8", "--set", "dataset.max_length=60"]) == 2
    assert "use max_length: 56 or 64" in capsys.readouterr().err
    assert main(["check", str(p), "--set", "sequence_parallel.ulysses_degree=3"]) == 2
    assert "must divide size=4" in capsys.readouterr().err


def test_dataset_messages_a_user_can_act_on(tmp_path):
    """Empty file, bad JSON line (file:line), all labels masked, eval_dataset named, 1-based rows with the file,
    and number-like strings kept as strings when a file mixes string and list message content."""
    from seqpar.errors import SeqParError
    from seqpar.train.dataset.prepare import prepare_examples

    tok = ByteTokenizer()
    (tmp_path / "empty.jsonl").write_text("\n")
    _err(lambda: load_rows(str(tmp_path / "empty.jsonl")), "is empty", "add rows")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b",}\n')
    _err(lambda: load_rows(str(tmp_path / "bad.jsonl"), "eval_dataset"), "eval_dataset", "bad.jsonl:2:", "invalid JSON")
    masked = _write_jsonl(tmp_path / "masked.jsonl", [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}] * 2)
    _err(lambda: build_examples(load_rows(str(masked)), "tokenized", "sft", tok, 64, False), "labels are -100",
         "train_on_prompt")
    rows = [{"messages": [{"role": "user", "content": "2 x 195.5?"}, {"role": "assistant", "content": "391."}]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                          {"role": "assistant", "content": "ok"}]}]
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert load_rows(str(mixed))[0]["messages"][1]["content"] == "391."  # not 391.0
    good = _write_jsonl(tmp_path / "good.jsonl", [{"text": "hello there"}])
    bad_eval = _write_jsonl(tmp_path / "ev.jsonl", [{"text": "fine"}, {"txt": "typo"}])
    cfg = config_from_dict({"model": {"name": "tiny:llama"}, "dataset": {"path": str(good), "max_length": 64},
                            "eval_dataset": {"path": str(bad_eval), "max_length": 64}, "output_dir": str(tmp_path)})
    with pytest.raises(SeqParError) as e:
        prepare_examples(cfg, tok, cfg.eval_dataset)
    assert str(e.value).startswith(f"eval_dataset {bad_eval}: row 2 "), str(e.value)


def test_yaml_syntax_error_and_missing_model_dir(tmp_path):
    """A YAML syntax error names file:line:column; a model path that does not exist says so (no hub lookup)."""
    from seqpar.train.model.load import model_heads

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: tiny:llama\ndataset:\n  path: x.jsonl\n")
    _err(lambda: load_config(bad), f"{bad}:2:8: YAML syntax error", "fix the file")
    sft_file = _write_jsonl(tmp_path / "s.jsonl", [{"text": "hello"}])
    for name in (str(tmp_path / "no" / "such"), "./missing-model", "~/nowhere/model"):
        t0 = time.time()
        _err(lambda n=name: model_heads(_cfg(sft_file, model=n)), "no such directory")
        assert time.time() - t0 < 5  # refused at once, no hub retries
