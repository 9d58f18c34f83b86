"""The family sweep (seqpar.hf.family_sweep, tools/family_sweep.py): every decoder-only causal-LM family of the
installed transformers, built tiny from its config, is exact under SP 2 (ring and Ulysses: loss, every real-token
logit, every parameter gradient within 1e-5 + 1e-5 x max|reference| of the unsharded model, fp32, train mode,
a packed row of two documents and a padded B=2 batch) or refused before any rank runs a forward, in one line that
names the feature and the fix. A FAIL (silently wrong, a crash, a refusal only inside the forward) fails here.
Also: the family list is transformers' causal-LM mapping, the tiny configs exercise the attention variants
(windows and chunks shorter than the documents, sinks, MLA's v head dim), planted silent errors are caught, and
docs/hf.md's generated table is the sweep's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from seqpar.errors import SeqParError
from seqpar.hf.family_configs import WINDOW, families, tiny_family_config
from seqpar.hf.family_sweep import BATCHES, MODES, _classify, build, sweep
from seqpar.hf.family_table import read_docs, render

ROOT = Path(__file__).resolve().parents[1]
PLANTED = ["llama", "qwen2_moe", "gpt2"]  # exact families (dense, MoE, learned positions) to plant errors in


def _tool():
    spec = importlib.util.spec_from_file_location("family_sweep_tool", ROOT / "tools" / "family_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results():
    """The whole sweep once, with `seqpar train`'s pre-launch model checks (what tools/family_sweep.py runs)."""
    return sweep(prelaunch=_tool().prelaunch)


def test_every_family_is_exact_or_refused(results):
    bad = [r for r in results if r.status == "FAIL"]
    assert not bad, f"{len(bad)} families FAIL under SP 2:\n" + "\n".join(
        f"  {r.model_type}: {r.detail}" for r in bad)


def test_results_name_a_reason(results):
    assert len(results) == len(families())
    for r in results:
        assert r.status == "exact" or r.detail.strip(), r
        if r.status == "exact":  # both modes, both batches, every check compared
            assert len(r.errors) == len(MODES) * len(BATCHES) * 3 and max(r.errors.values()) <= 1.0, r
    exact = {r.model_type for r in results if r.status == "exact"}
    assert set(PLANTED) <= exact


def test_family_list_is_the_causal_lm_mapping():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fs = families()
    assert [f.model_type for f in fs] == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    swept = {f.model_type for f in fs if f.excluded is None}
    assert {"llama", "mistral", "gemma3_text", "qwen3", "deepseek_v3", "gpt_oss", "llama4_text", "mixtral"} <= swept
    reasons = {f.model_type: f.excluded for f in fs if f.excluded}
    assert "encoder-decoder" in reasons["bart"] and "composite" in reasons["llama4"]
    assert "same model class" in reasons["exaone"]  # LlamaForCausalLM: swept once, as llama


def test_tiny_configs_exercise_the_attention_variants():
    shortest = min(n for rows in BATCHES.values() for row in rows for n in row)
    assert WINDOW < shortest
    mistral = tiny_family_config("mistral")
    assert mistral.sliding_window == WINDOW and mistral.num_attention_heads == 4 and mistral.num_key_value_heads == 2
    gemma3 = tiny_family_config("gemma3_text")
    assert {"sliding_attention", "full_attention"} <= set(gemma3.layer_types)
    llama4 = tiny_family_config("llama4_text")
    assert llama4.attention_chunk_size == WINDOW and 0 in llama4.no_rope_layers  # chunked and NoPE layers
    ds = tiny_family_config("deepseek_v3")
    assert ds.v_head_dim != ds.qk_nope_head_dim + ds.qk_rope_head_dim  # MLA: v head dim unlike qk's
    oss = build("gpt_oss")
    assert any(n.endswith("sinks") for n, _ in oss.named_parameters())
    assert oss.config.sliding_window == WINDOW and "sliding_attention" in oss.config.layer_types
    for m in (build("llama"), oss):
        assert sum(p.numel() for p in m.parameters()) < 500_000 and all(p.dtype == torch.float32
                                                                         for p in m.parameters())


# ----------------------------------------------------------------------------- planted errors
def _perturb_one_rank(model, mesh):
    """SP rank 1's attention outputs off by +-1e-4 (alternating along the hidden dim, so that no LayerNorm's mean
    removes it): a small silent error on one shard."""
    def off(t):
        return t + 1e-4 * (1 - 2 * (torch.arange(t.shape[-1]) % 2))

    def hook(module, args, out):
        return (off(out[0]), *out[1:]) if isinstance(out, tuple) else off(out)

    if mesh.sp_rank == 1:
        for m in model.modules():
            if type(m).__name__.endswith("Attention"):
                m.register_forward_hook(hook)


def _local_attention(model, mesh):
    """The classic SP bug: attention runs on the local shard only (the model's own attention, not seqpar's)."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None:
            cfg._attn_implementation = "sdpa"


@pytest.mark.parametrize("plant", [_perturb_one_rank, _local_attention])
def test_planted_silent_error_fails(plant):
    got = sweep(PLANTED, plant=plant)
    for r in got:
        assert r.status == "FAIL" and r.detail.startswith("silently wrong"), r
        assert max(r.errors.values()) > 1.0


def test_late_refusal_and_crash_fail():
    def refuse_in_forward(model, mesh):
        model.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(SeqParError("feature: change it")))

    def crash(model, mesh):
        model.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))

    late, = sweep(["llama"], plant=refuse_in_forward)
    assert late.status == "FAIL" and late.detail.startswith("refused only in the forward"), late
    boom, = sweep(["llama"], plant=crash)
    assert boom.status == "FAIL" and boom.detail.startswith("crash: RuntimeError: boom"), boom


def test_refusal_must_be_one_line_naming_the_fix():
    fam = families()[0]
    ok = _classify(fam, [{m: ("refused", "feature X is not supported: set config.x = None") for m in MODES}])
    assert ok.status == "refused"
    for msg in ("feature X is not supported", "feature X:\nset config.x = None"):
        assert _classify(fam, [{m: ("refused", msg) for m in MODES}]).status == "FAIL", msg


# ----------------------------------------------------------------------------- docs
def test_docs_table_is_the_sweeps(results, tmp_path):
    """docs/hf.md's generated table holds the sweep's families and statuses, and the same reasons except for FAILs
    (their error sizes may move in the last digit); regenerate it with tools/family_sweep.py --write-docs."""
    committed = read_docs(ROOT / "docs" / "hf.md")
    import transformers

    fresh_md = tmp_path / "fresh.md"
    fresh_md.write_text(render(results, transformers.__version__))  # the section, markers included
    fresh = read_docs(fresh_md)
    hint = "run `python tools/family_sweep.py --write-docs docs/hf.md`"
    assert {(r[0], r[2]) for r in committed} == {(r[0], r[2]) for r in fresh}, hint
    assert [r for r in committed if r[2] != "FAIL"] == [r for r in fresh if r[2] != "FAIL"], hint
