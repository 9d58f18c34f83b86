"""`seqpar check` / the launcher see model.kwargs config overrides (max_position_embeddings, rope_scaling) of a
local HF model, as from_pretrained applies them when `seqpar train` builds the model (before: config.json alone)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny Llama whose config.json says max_position_embeddings=64."""
    from seqpar.hf import tiny_model

    d = tmp_path_factory.mktemp("kwcfg") / "llama64"
    model = tiny_model("llama", num_heads=4, num_kv_heads=2, vocab_size=300, max_position_embeddings=64, seed=0)
    model.save_pretrained(d)
    return d


def _cfg(model_dir, tmp_path, max_length: int, **kwargs):
    from seqpar.train.config import config_from_dict

    return config_from_dict({"model": {"name": str(model_dir), "kwargs": kwargs},
                             "dataset": {"path": str(tmp_path / "unused.jsonl"), "max_length": max_length},
                             "output_dir": str(tmp_path / "out"), "progress": False})


def test_check_sees_model_kwargs_positions_and_rope_scaling(model_dir, tmp_path):
    """The length check refuses max_length > config.json's 64 positions, accepts it once model.kwargs raise
    max_position_embeddings or add RoPE scaling (linear x4: 256), and the config it checks is the one the
    model is built with (load_model: from_pretrained with the same kwargs)."""
    from seqpar.errors import SeqParError
    from seqpar.train.model.checks import check_model
    from seqpar.train.model.load import load_model, model_config

    rows = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    with pytest.raises(SeqParError, match="max_length=128 exceeds the model's max_position_embeddings=64"):
        check_model(_cfg(model_dir, tmp_path, 128), rows)
    raised = _cfg(model_dir, tmp_path, 128, max_position_embeddings=256, attn_implementation="eager")
    check_model(raised, rows)  # before the fix: refused (config.json's 64)
    with pytest.raises(SeqParError, match="max_length=512 exceeds the model's max_position_embeddings=256"):
        check_model(_cfg(model_dir, tmp_path, 512, max_position_embeddings=256), rows)
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    check_model(_cfg(model_dir, tmp_path, 256, rope_parameters=linear), rows)
    with pytest.raises(SeqParError, match=r"max_length=257 exceeds .*rope_scaling \(linear, factor 4 x 64\)=256"):
        check_model(_cfg(model_dir, tmp_path, 257, rope_scaling=linear), rows)  # the older name
    # transformers 5 replaces the whole RoPE dict: without rope_theta the model would fail to build.
    with pytest.raises(SeqParError, match="without rope_theta"):
        check_model(_cfg(model_dir, tmp_path, 128, rope_scaling={"rope_type": "linear", "factor": 4.0}), rows)
    # The same config the model is built with: positions, RoPE and the model-only kwarg all as loaded.
    for cfg in (raised, _cfg(model_dir, tmp_path, 256, rope_parameters=linear)):
        seen, built = model_config(cfg), load_model(cfg).config
        assert seen.max_position_embeddings == built.max_position_embeddings
        assert seen.rope_parameters == built.rope_parameters
    assert model_config(raised).max_position_embeddings == 256
    assert load_model(raised).config._attn_implementation == "eager"


def test_position_limit_rope_conventions():
    """Extended contexts as published configs state them: an original length times the factor (YaRN as
    Qwen2.5 documents it, DeepSeek-V3), a max_position_embeddings already past the extension (Llama 3.1),
    none ('default'), and per-layer-type RoPE (the smallest)."""
    from transformers import LlamaConfig

    from seqpar.train.model.checks import position_limit

    def cfg(n, rope):
        c = LlamaConfig(max_position_embeddings=n, hidden_size=16, num_attention_heads=2, intermediate_size=32)
        c.rope_parameters = rope
        return c

    assert position_limit(cfg(32768, {"rope_type": "default", "rope_theta": 1e6}))[0] == 32768
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert position_limit(cfg(32768, yarn))[0] == 131072
    assert position_limit(cfg(163840, {**yarn, "factor": 40.0, "original_max_position_embeddings": 4096}))[0] == 163840
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert position_limit(cfg(131072, llama3))[0] == 131072
    per_type = {"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {"rope_type": "default"}}
    assert position_limit(cfg(1000, per_type))[0] == 1000
    assert position_limit(cfg(1000, {"full_attention": {"rope_type": "linear", "factor": 2.0},
                                     "sliding_attention": {"rope_type": "linear", "factor": 4.0}}))[0] == 2000
