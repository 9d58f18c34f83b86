"""The attention kernel as an option: `attention_kernel:` in seqpar train configs, `attention_kernel=` in the
drop-ins and apply_sequence_parallel; the choice is printed once per process; a kernel that cannot run is
refused with the reason before any communication."""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar import SeqParError
from seqpar.hf import apply_sequence_parallel, remove_sequence_parallel
from seqpar.hf.attention_fn import _ANNOUNCED
from seqpar.hf.models import tiny_model


def _config(**kw):
    from seqpar.train.config import config_from_dict

    return config_from_dict({"model": {"name": "tiny:llama"}, "dataset": {"path": "x.jsonl", "max_length": 64}, **kw})


def test_config_takes_a_kernel_name_and_refuses_others():
    assert _config().attention_kernel == "auto"
    assert _config(attention_kernel="cudnn").attention_kernel == "cudnn"
    with pytest.raises(SeqParError, match="attention_kernel"):
        _config(attention_kernel="fa9")


def test_prepare_spec_carries_the_kernel():
    from seqpar.train.model.build import prepare_spec

    assert prepare_spec(_config(attention_kernel="math")).attention_kernel == "math"


def _logits(model, ids, pos):
    return model(input_ids=ids, position_ids=pos).logits


def test_forced_math_kernel_equals_auto_and_is_announced_once(capsys):
    mesh = seqpar.init_mesh(1)
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None]
    model = tiny_model("llama", 4, 2, vocab_size=100)
    _ANNOUNCED.clear()
    apply_sequence_parallel(model, mesh)
    want = _logits(model, ids, pos)
    remove_sequence_parallel(model)
    apply_sequence_parallel(model, mesh, attention_kernel="math")
    got = _logits(model, ids, pos)
    _logits(model, ids, pos)
    out = capsys.readouterr().out
    assert out.count("[seqpar] attention kernel: cpu (auto; cpu") == 1
    assert out.count("[seqpar] attention kernel: math (forced; cpu") == 1
    assert torch.allclose(got, want, atol=1e-5)


def test_kernels_that_cannot_run_are_refused():
    mesh = seqpar.init_mesh(1)
    model = tiny_model("llama", 4, 2, vocab_size=100)
    with pytest.raises(SeqParError, match="unknown attention kernel 'fa9'"):
        apply_sequence_parallel(model, mesh, attention_kernel="fa9")
    apply_sequence_parallel(model, mesh, attention_kernel="flash")  # a name it knows: checked per call
    with pytest.raises(SeqParError, match="'flash' runs on cuda tensors, not cpu.*'auto' \\(picks 'cpu'"):
        _logits(model, torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None])


def test_trainer_drop_in_refuses_an_unknown_kernel(tmp_path):
    from transformers import TrainingArguments

    from seqpar.hf import SequenceParallelTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(SeqParError, match="unknown attention kernel 'fa9'"):
        SequenceParallelTrainer(model=tiny_model("llama", 4, 2, vocab_size=100), args=args, attention_kernel="fa9")


def test_head_chunks_reach_attention_and_keep_the_result():
    from seqpar.hf import PrepareSpec, prepare_model

    mesh = seqpar.init_mesh(1)
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None]
    want = _logits(prepare_model(tiny_model("llama", 4, 2, vocab_size=100), mesh, PrepareSpec(fused_loss=False)),
                   ids, pos)
    model = prepare_model(tiny_model("llama", 4, 2, vocab_size=100), mesh,
                          PrepareSpec(fused_loss=False, attention_head_chunks=2))
    assert torch.allclose(_logits(model, ids, pos), want, atol=1e-5)
    assert _config(memory={"attention_head_chunks": 4}).memory.attention_head_chunks == 4
    with pytest.raises(SeqParError, match="attention_head_chunks"):
        _config(memory={"attention_head_chunks": 0})
    with pytest.raises(SeqParError, match="head_chunks must be an int >= 1, got 0"):
        prepare_model(tiny_model("llama", 4, 2, vocab_size=100), mesh, PrepareSpec(attention_head_chunks=0))
