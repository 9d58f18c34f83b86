"""Dataset formats people have (Alpaca, ShareGPT, TRL conversational / prompt-completion / DPO), options
(train_on_prompt, mask_history, chat_template, DPO prompt truncation) and the counts of what changed.
Unit tests: no process group, no spawn (fast)."""

from __future__ import annotations

import json

import pytest

from seqpar import SeqParError
from seqpar.train.config import config_from_dict, load_config, steps_for_epochs
from seqpar.train.dataset.formats import detect_format
from seqpar.train.dataset.tokenize import IGNORE, build_examples, describe_stats, tokenize_dpo, tokenize_sft
from seqpar.train.model.tokenizers import ByteTokenizer, HFTokenizer, load_chat_template

BT = ByteTokenizer()
TINY = {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2}}


def _sup(ex):
    """The supervised token ids of a tokenized row."""
    return [t for t, lab in zip(ex["input_ids"], ex["labels"]) if lab != IGNORE]


def _turn(text):
    return BT.encode(text) + [BT.eos_token_id]


def _conv(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


@pytest.fixture(scope="module")
def smol():
    from seqpar.hf import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


# ----------------------------------------------------------------------------- formats -> the same conversation
def test_alpaca_input_system_history():
    row = {"instruction": "Sum", "input": "1 2", "output": "3", "system": "S",
           "history": [["hi", "hello"], ["how", "fine"]]}
    ex = tokenize_sft(row, "instruction", BT)
    msgs = _conv(("system", "S"), ("user", "hi"), ("assistant", "hello"), ("user", "how"), ("assistant", "fine"),
                 ("user", "Sum\n\n1 2"), ("assistant", "3"))
    assert ex["input_ids"] == BT.chat(msgs, add_generation_prompt=False)
    assert _sup(ex) == _turn("hello") + _turn("fine") + _turn("3")  # history answers are trained by default
    # input is no longer dropped
    assert BT.encode("Sum\n\n1 2") == ex["input_ids"][ex["input_ids"].index(ord("S"), 20):][:8]
    hist = tokenize_sft(row, "instruction", BT, mask_history=True)
    assert hist["input_ids"] == ex["input_ids"] and _sup(hist) == _turn("3")
    allp = tokenize_sft(row, "instruction", BT, train_on_prompt=True)
    assert allp["labels"] == allp["input_ids"] == ex["input_ids"]


def test_sharegpt_roles_and_system_column():
    row = {"system": "S", "conversations": [
        {"from": "human", "value": "q"}, {"from": "function_call", "value": '{"f": 1}'},
        {"from": "observation", "value": "42"}, {"from": "gpt", "value": "a"}]}
    assert detect_format(list(row)) == "sharegpt"
    ex = tokenize_sft(row, "sharegpt", BT)
    msgs = _conv(("system", "S"), ("user", "q"), ("assistant", '{"f": 1}'), ("tool", "42"), ("assistant", "a"))
    assert ex["input_ids"] == BT.chat(msgs, add_generation_prompt=False)
    assert _sup(ex) == _turn('{"f": 1}') + _turn("a")
    with pytest.raises(SeqParError, match="unknown message role 'narrator'"):
        tokenize_sft({"conversations": [{"from": "narrator", "value": "x"}]}, "sharegpt", BT)


def test_trl_messages_content_null_and_parts():
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}]},
                        {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]},
                        {"role": "tool", "content": "r"}, {"role": "assistant", "content": "ok"}]}
    ex = tokenize_sft(row, "chat", BT)
    msgs = _conv(("user", "hey"), ("assistant", ""), ("tool", "r"), ("assistant", "ok"))
    assert ex["input_ids"] == BT.chat(msgs, add_generation_prompt=False)
    assert _sup(ex) == [BT.eos_token_id] + _turn("ok")


def test_trl_prompt_completion_strings_and_messages():
    s = tokenize_sft({"prompt": "p", "completion": "c"}, "instruction", BT)
    assert _sup(s) == _turn("c")
    row = {"prompt": _conv(("system", "S"), ("user", "u1"), ("assistant", "a1"), ("user", "u2")),
           "completion": _conv(("assistant", "a2"))}
    m = tokenize_sft(row, "instruction", BT)
    assert m["input_ids"] == BT.chat(row["prompt"] + row["completion"], add_generation_prompt=False)
    assert _sup(m) == _turn("a2")  # the prompt's assistant turn is context, not a target


def test_trl_dpo_conversational_and_implicit_prompt():
    prompt = _conv(("user", "q"))
    row = {"prompt": prompt, "chosen": _conv(("assistant", "good")), "rejected": _conv(("assistant", "bad"))}
    ex = tokenize_dpo(row, BT)
    assert ex["prompt_input_ids"] == BT.chat(prompt, add_generation_prompt=True)
    assert ex["chosen_input_ids"] == _turn("good") and ex["rejected_input_ids"] == _turn("bad")
    implicit = {"chosen": prompt + _conv(("assistant", "good")), "rejected": prompt + _conv(("assistant", "bad"))}
    assert tokenize_dpo(implicit, BT) == ex
    sharegpt = {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "good"},
                "rejected": {"from": "gpt", "value": "bad"}}
    assert detect_format(list(sharegpt)) == "dpo" and tokenize_dpo(sharegpt, BT) == ex
    examples, stats = build_examples([row, implicit], "auto", "dpo", BT, 64, False)
    assert len(examples) == 2 and stats["dropped_long_prompt"] == 0


def test_hf_tokenizer_conversational_dpo_and_chat_template_override(smol, tmp_path, monkeypatch):
    tok = HFTokenizer(smol)
    row = {"prompt": _conv(("user", "What is 2+2?")), "chosen": _conv(("assistant", "4")),
           "rejected": _conv(("assistant", "5"))}
    ex = tokenize_dpo(row, tok)  # used to crash: 'list' object has no attribute 'encode'
    full = smol.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in full  # SmolLM2 injects a default system prompt
    assert ex["prompt_input_ids"] + ex["chosen_input_ids"] == tok.encode(full)
    assert smol.decode(ex["chosen_input_ids"]).startswith("4<|im_end|>")

    # Override with a template file (no default system prompt): relative to the config file.
    tpl = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "plain.jinja").write_text(tpl)
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": row["prompt"] + row["chosen"]}) + "\n")
    (tmp_path / "c.yaml").write_text("model: smollm2\ndataset: {path: d.jsonl, max_length: 64, "
                                     "chat_template: plain.jinja}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert load_chat_template(cfg.dataset.chat_template) == tpl
    import copy

    import seqpar.hf
    from seqpar.train.dataset.prepare import prepare_examples
    from seqpar.train.model.load import load_tokenizer

    monkeypatch.setattr(seqpar.hf, "load_smollm2_tokenizer", lambda: copy.deepcopy(smol))  # no second load
    plain = load_tokenizer(cfg)
    assert smol.chat_template != tpl  # the override went to the copy
    assert plain.tok.chat_template == tpl
    (ex2,), stats = prepare_examples(cfg, plain)
    text = smol.decode(ex2["input_ids"])
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    assert smol.decode(_sup(ex2)) == "4<|im_end|>\n" and stats["truncated"] == 0
    with pytest.raises(SeqParError, match="neither a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    tiny = config_from_dict({"model": TINY, "dataset": {"path": "x", "max_length": 8, "chat_template": tpl}})
    with pytest.raises(SeqParError, match="needs an HF tokenizer"):
        load_tokenizer(tiny)


# ----------------------------------------------------------------------------- what changed is counted
def test_sft_truncated_and_dropped_counts():
    rows = [{"instruction": "q", "output": "a" * 5},           # fits
            {"instruction": "q", "output": "a" * 40},          # truncated, keeps supervised tokens
            {"instruction": "x" * 40, "output": "a"}]          # prompt fills max_length: dropped
    examples, stats = build_examples(rows, "auto", "sft", BT, 32, False)
    assert len(examples) == 2 and all(len(e["input_ids"]) <= 32 for e in examples)
    assert stats == {"rows": 3, "truncated": 1, "dropped_unsupervised": 1, "prompt_truncated": 0,
                     "dropped_long_prompt": 0, "identical_pairs": 0}
    lines = describe_stats(stats, 32)
    assert any("1 of 3 rows dropped" in x for x in lines) and any("1 of 3 rows truncated" in x for x in lines)


def test_dpo_long_prompt_skipped_or_truncated():
    good = {"prompt": "p", "chosen": "yes", "rejected": "no"}
    long = {"prompt": "abcdefgh" * 8, "chosen": "yes", "rejected": "no"}   # 64-byte prompt + chat tokens > 32
    examples, stats = build_examples([good, long, good], "auto", "dpo", BT, 32, False)
    assert len(examples) == 2 and stats["dropped_long_prompt"] == 1 and stats["prompt_truncated"] == 0
    with pytest.raises(SeqParError, match="prompt alone reaches.*max_prompt_length"):
        build_examples([long], "auto", "dpo", BT, 32, False)
    full = tokenize_dpo(long, BT)["prompt_input_ids"]
    for mode, want in (("keep_end", full[-24:]), ("keep_start", full[:24])):
        ex, st = build_examples([good, long], "auto", "dpo", BT, 32, False, max_prompt_length=24, truncation_mode=mode)
        assert len(ex) == 2 and st["prompt_truncated"] == 1 and st["dropped_long_prompt"] == 0
        assert ex[1]["prompt_input_ids"] == want and ex[1]["chosen_input_ids"] == _turn("yes")
    pre = dict(long, ref_chosen_logps=-1.0, ref_rejected_logps=-2.0)
    with pytest.raises(SeqParError, match="precomputed reference log-probs"):
        build_examples([pre], "auto", "dpo", BT, 32, False, max_prompt_length=20)


# ----------------------------------------------------------------------------- config: options, epochs, paths
def test_config_options_and_epochs(tmp_path):
    base = {"model": TINY, "dataset": {"path": "d.jsonl", "max_length": 64}}
    cfg = config_from_dict({**base, "finetuning": {"method": "lora", "targets": "all"}})
    assert cfg.finetuning.targets == "all-linear"
    assert config_from_dict({**base, "finetuning": {"targets": "q_proj, v_proj"}}).finetuning.targets == ["q_proj",
                                                                                                           "v_proj"]
    assert config_from_dict(base).max_steps == 10
    with pytest.raises(SeqParError, match="max_steps or num_epochs, not both"):
        config_from_dict({**base, "max_steps": 3, "num_epochs": 1})
    with pytest.raises(SeqParError, match="warmup_steps or schedule.warmup_ratio"):
        config_from_dict({**base, "schedule": {"warmup_steps": 2, "warmup_ratio": 0.1}})
    with pytest.raises(SeqParError, match="max_prompt_length=64 leaves no room"):
        config_from_dict({**base, "dataset": {**base["dataset"], "max_prompt_length": 64}})
    ep = config_from_dict({**base, "num_epochs": 2.5, "micro_batch_size": 2, "grad_accum": 3,
                           "schedule": {"warmup_ratio": 0.1}})
    # 11 rows over dp=2: 6 per slot; 2.5 epochs = 15 rows = ceil(15 / 6) = 3 steps
    assert ep.max_steps is None and steps_for_epochs(ep, 11, 2) == 3 and ep.schedule.warmup(30) == 3
    ev = config_from_dict({**base, "eval_dataset": "e.jsonl", "eval_every": 2, "report_to": "none"})
    assert ev.eval_dataset.path == "e.jsonl" and ev.eval_dataset.max_length == 64 and ev.report_to == []
    # Relative output_dir / paths in a file: relative to the file; command-line overrides: to the cwd.
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "sub" / "c.yaml").write_text("model: tiny:llama\ndataset: {path: d.jsonl, max_length: 64}\n"
                                             "eval_dataset: d.jsonl\noutput_dir: runs/a\nnum_epochs: 1\n")
    cfg = load_config(tmp_path / "sub" / "c.yaml")
    assert cfg.output_dir == str((tmp_path / "sub" / "runs" / "a").absolute())
    assert cfg.eval_dataset.path == str((tmp_path / "sub" / "d.jsonl").absolute())
    cli = load_config(tmp_path / "sub" / "c.yaml", {"output_dir": "out", "max_steps": 4})
    assert cli.output_dir == "out" and cli.max_steps == 4 and cli.num_epochs is None


def test_report_to_tensorboard_needs_the_package(monkeypatch):
    import sys

    from seqpar.train.config import validate_for_launch

    cfg = config_from_dict({"model": TINY, "dataset": {"path": "d.jsonl", "max_length": 64},
                            "report_to": "tensorboard"})
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(SeqParError, match="pip install tensorboard"):
        validate_for_launch(cfg, 1, num_heads=4, num_kv_heads=2)


def test_lora_targets_all_is_every_decoder_linear_but_lm_head():
    from peft import LoraConfig, get_peft_model

    from seqpar.hf import tiny_model

    f = config_from_dict({"model": TINY, "dataset": {"path": "d.jsonl", "max_length": 64},
                          "finetuning": {"method": "lora", "targets": "all"}}).finetuning
    model = get_peft_model(tiny_model("llama", 4, 2, vocab_size=300, seed=0),
                           LoraConfig(r=f.r, lora_alpha=f.alpha, target_modules=f.targets))
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_tensorboard_rows_rank0_only(tmp_path, monkeypatch):
    """metrics rows -> TensorBoard scalars on rank 0 (a stand-in SummaryWriter: tensorboard is optional)."""
    import sys
    import types

    from seqpar.train.loop.metrics import log_row, open_tensorboard

    calls = []

    class Writer:
        def __init__(self, log_dir):
            calls.append(("dir", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def flush(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    cfg = config_from_dict({"model": TINY, "dataset": {"path": "d.jsonl", "max_length": 64},
                            "report_to": "tensorboard"})
    assert open_tensorboard(cfg, 1, tmp_path) is None
    loop = types.SimpleNamespace(tensorboard=open_tensorboard(cfg, 0, tmp_path))
    log_row(loop, tmp_path / "m.jsonl", {"step": 3, "loss": 1.5, "lr": 0.1})
    log_row(loop, tmp_path / "m.jsonl", {"step": 3, "eval_loss": 1.25})
    assert calls == [("dir", str(tmp_path / "tensorboard")), ("train/loss", 1.5, 3), ("train/lr", 0.1, 3),
                     ("eval/eval_loss", 1.25, 3)]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_dpo_identical_pairs_are_counted_and_reported():
    """chosen == rejected (within max_length) teaches nothing: the DPO loss of such a pair stays at ln 2."""
    rows = [{"prompt": "q", "chosen": "same answer", "rejected": "same answer"},
            {"prompt": "q", "chosen": "good", "rejected": "bad"},
            {"prompt": "q", "chosen": "long equal start x", "rejected": "long equal start y"}]
    _, stats = build_examples(rows, "auto", "dpo", BT, 64, False)
    assert stats["identical_pairs"] == 1
    ex = tokenize_dpo(rows[2], BT)
    same = next(i for i, (a, b) in enumerate(zip(ex["chosen_input_ids"], ex["rejected_input_ids"])) if a != b)
    cut = len(ex["prompt_input_ids"]) + same  # max_length ends before the last word, where the pair differs
    _, stats = build_examples(rows, "auto", "dpo", BT, cut, False)
    assert stats["identical_pairs"] == 2
    assert any("chosen == rejected" in line and "ln 2" in line for line in describe_stats(stats, cut))
