"""The HF / TRL drop-ins refuse bad arguments and rows at construction with one SeqParError naming the fix, on
every rank alike, before any collective: a sequence_parallel_size of 0 (it used to mean "the world size"), rows
without the columns the trainer reads (a KeyError in training, or on rank 0 while rank 1 failed in gloo), and
TRL's default bf16 config on a machine without an accelerator builds and says so in one line."""

from __future__ import annotations

import pytest
import torch

from seqpar.errors import SeqParError
from seqpar.spawn import run_distributed


def _chat_rows():
    import datasets

    return datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "alpha beta"},
                                                     {"role": "assistant", "content": "gamma delta"}]}] * 4)


def _cases(out: str) -> dict[str, str]:
    """Each case's SeqParError message (or "no error"), on this rank of a 2-rank world."""
    import datasets
    from transformers import TrainingArguments
    from trl import SFTConfig

    from seqpar.hf import SequenceParallelTrainer, load_smollm2_tokenizer, tiny_model
    from seqpar.trl import SequenceParallelSFTTrainer

    tok = load_smollm2_tokenizer()
    hf_args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_steps=1)
    trl_args = SFTConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, max_steps=1)
    model = lambda: tiny_model("qwen2", 2, 1, vocab_size=len(tok), seed=0)  # noqa: E731
    text_only = datasets.Dataset.from_list([{"text": "alpha beta gamma"}] * 4)
    qa = datasets.Dataset.from_list([{"question": "alpha?", "answer": "beta"}] * 4)
    tokenized = datasets.Dataset.from_list([{"input_ids": list(range(3, 19))}] * 4)
    cases = {
        "hf text rows": lambda: SequenceParallelTrainer(model=model(), args=hf_args, train_dataset=text_only),
        "hf sp 0": lambda: SequenceParallelTrainer(model=model(), args=hf_args, train_dataset=tokenized,
                                                   sequence_parallel_size=0),
        "trl question/answer rows": lambda: SequenceParallelSFTTrainer(
            model=model(), args=trl_args, train_dataset=qa, processing_class=tok),
        "trl sp 0": lambda: SequenceParallelSFTTrainer(model=model(), args=trl_args, train_dataset=_chat_rows(),
                                                       processing_class=tok, sequence_parallel_size=0),
    }
    said = {}
    for name, make in cases.items():
        try:
            make()
            said[name] = "no error"
        except SeqParError as e:
            said[name] = str(e)
    return said


def test_refused_on_every_rank(tmp_path):
    """2 ranks: the same message on both for every case (the issue's: KeyError 'input_ids' on every rank; TRL's
    KeyError 'text' on rank 0 and "Connection closed by peer" on rank 1; sp 0 trained as SP=2)."""
    said = run_distributed(_cases, 2, str(tmp_path), timeout=400)
    assert said[0] == said[1], said
    got = said[0]
    assert got["hf text rows"].startswith("SequenceParallelTrainer: train_dataset has columns ['text'], none of the "
                                          "formats it reads ('input_ids')"), got
    assert "seqpar.trl.SequenceParallelSFTTrainer" in got["hf text rows"]
    assert got["trl question/answer rows"].startswith(
        "SequenceParallelSFTTrainer: train_dataset has columns ['question', 'answer']"), got
    assert "rename_columns" in got["trl question/answer rows"] and "formatting_func=" in got["trl question/answer rows"]
    for name in ("hf sp 0", "trl sp 0"):
        assert "sequence_parallel_size=0: give a positive int, or leave it unset (the world size)" in got[name], got


def test_other_rows_and_sizes_refused(tmp_path):
    """One process: DPO rows (HF and TRL), GRPO rows without a prompt, an eval dataset, a degree of 0, a mesh=
    that disagrees with sequence_parallel_size; a formatting_func lifts the SFT format check."""
    import datasets
    from transformers import TrainingArguments
    from trl import DPOConfig, GRPOConfig, SFTConfig

    from seqpar import init_mesh
    from seqpar.hf import SequenceParallelDPOTrainer, SequenceParallelTrainer, load_smollm2_tokenizer, tiny_model
    from seqpar.trl import SequenceParallelDPOTrainer as TRLDPO
    from seqpar.trl import SequenceParallelGRPOTrainer, SequenceParallelSFTTrainer

    tok = load_smollm2_tokenizer()
    model = lambda: tiny_model("qwen2", 2, 1, vocab_size=len(tok), seed=0)  # noqa: E731
    out = str(tmp_path)
    hf_args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True)
    pairs = datasets.Dataset.from_list([{"prompt": "a", "good": "b", "bad": "c"}] * 4)
    tokenized = datasets.Dataset.from_list([{"input_ids": list(range(3, 19))}] * 4)
    with pytest.raises(SeqParError, match=r"train_dataset has columns \['prompt', 'good', 'bad'\].*'prompt_input_ids'"):
        SequenceParallelDPOTrainer(model=model(), args=hf_args, train_dataset=pairs)
    with pytest.raises(SeqParError, match=r"eval_dataset has columns \['text'\]"):
        SequenceParallelTrainer(model=model(), args=hf_args, train_dataset=tokenized,
                                eval_dataset=datasets.Dataset.from_list([{"text": "a"}]))
    with pytest.raises(SeqParError, match="ulysses_degree=0: give a positive int"):
        SequenceParallelTrainer(model=model(), args=hf_args, train_dataset=tokenized, ulysses_degree=0)
    with pytest.raises(SeqParError, match=r"mesh= and sequence_parallel_size=2 \(the mesh has 1\) disagree"):
        SequenceParallelTrainer(model=model(), args=hf_args, train_dataset=tokenized, mesh=init_mesh(1),
                                sequence_parallel_size=2)
    dpo_args = DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(SeqParError, match="'chosen' \\+ 'rejected'"):
        TRLDPO(model=model(), args=dpo_args, train_dataset=pairs, processing_class=tok)
    grpo_args = GRPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, loss_type="grpo",
                           per_device_train_batch_size=4, num_generations=2)
    with pytest.raises(SeqParError, match="has columns \\['question'\\].*to 'prompt'"):
        SequenceParallelGRPOTrainer(model=model(), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                                    args=grpo_args, train_dataset=datasets.Dataset.from_list([{"question": "a"}] * 4),
                                    processing_class=tok, sequence_parallel_size=1)
    qa = datasets.Dataset.from_list([{"question": "alpha?", "answer": "beta"}] * 4)
    trainer = SequenceParallelSFTTrainer(
        model=model(), args=SFTConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False), train_dataset=qa,
        processing_class=tok, sequence_parallel_size=1, formatting_func=lambda r: r["question"] + " " + r["answer"])
    assert "input_ids" in trainer.train_dataset.column_names


def test_trl_default_config_on_a_cpu_only_machine(tmp_path, capsys):
    """docs/trl.md's example config (TRL's bf16 default, no use_cpu) on a machine without an accelerator: it builds
    (transformers used to raise "Your setup doesn't support bf16/gpu" from every rank) and the drop-in prints its one
    line about bf16 on CPU."""
    if torch.accelerator.current_accelerator() is not None:
        pytest.skip("checks a machine without CUDA or another accelerator (TRL's bf16 default is for one)")
    from trl import SFTConfig

    from seqpar.hf import load_smollm2_tokenizer, tiny_model
    from seqpar.hf.trainer import BF16_ON_CPU
    from seqpar.trl import SequenceParallelSFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, report_to=[])
    assert args.bf16 and args.use_cpu
    tok = load_smollm2_tokenizer()
    capsys.readouterr()
    SequenceParallelSFTTrainer(model=tiny_model("qwen2", 2, 1, vocab_size=len(tok), seed=0), args=args,
                               train_dataset=_chat_rows(), processing_class=tok, sequence_parallel_size=1)
    assert capsys.readouterr().out.count(BF16_ON_CPU) == 1


def test_dynamic_size_refused_by_every_dropin(tmp_path):
    """sequence_parallel_size='dynamic' (length-aware SP, `seqpar train` only): refused by the HF Trainer / DPO
    drop-ins and the TRL SFT / DPO / GRPO ones at construction, naming why and what to use instead."""
    import datasets
    from transformers import TrainingArguments
    from trl import DPOConfig, GRPOConfig, SFTConfig

    from seqpar.hf import SequenceParallelDPOTrainer, SequenceParallelTrainer, load_smollm2_tokenizer, tiny_model
    from seqpar.trl import SequenceParallelDPOTrainer as TRLDPO
    from seqpar.trl import SequenceParallelGRPOTrainer, SequenceParallelSFTTrainer

    tok = load_smollm2_tokenizer()
    model = lambda: tiny_model("qwen2", 2, 1, vocab_size=len(tok), seed=0)  # noqa: E731
    out = str(tmp_path)
    hf_args = TrainingArguments(output_dir=out, report_to=[], use_cpu=True)
    tokenized = datasets.Dataset.from_list([{"input_ids": list(range(3, 19))}] * 4)
    pairs = datasets.Dataset.from_list([{"prompt_input_ids": [3, 4], "chosen_input_ids": [5],
                                         "rejected_input_ids": [6]}] * 4)
    trl_pairs = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}] * 4)
    prompts = datasets.Dataset.from_list([{"prompt": "a"}] * 4)
    dyn = {"sequence_parallel_size": "dynamic"}
    makers = [
        lambda: SequenceParallelTrainer(model=model(), args=hf_args, train_dataset=tokenized, **dyn),
        lambda: SequenceParallelDPOTrainer(model=model(), args=hf_args, train_dataset=pairs, ref_model=model(), **dyn),
        lambda: SequenceParallelSFTTrainer(model=model(), args=SFTConfig(output_dir=out, report_to=[], use_cpu=True,
                                                                         bf16=False),
                                           train_dataset=_chat_rows(), processing_class=tok, **dyn),
        lambda: TRLDPO(model=model(), args=DPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False),
                       train_dataset=trl_pairs, processing_class=tok, **dyn),
        lambda: SequenceParallelGRPOTrainer(
            model=model(), reward_funcs=lambda completions, **_: [0.0] * len(completions), train_dataset=prompts,
            args=GRPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False, loss_type="grpo",
                            per_device_train_batch_size=4, num_generations=2), processing_class=tok, **dyn),
    ]
    for make in makers:
        with pytest.raises(SeqParError, match=r"sequence_parallel_size='dynamic' \(length-aware SP\) runs in "
                                              r"`seqpar train` only.*size: dynamic, max_local_tokens"):
            make()
