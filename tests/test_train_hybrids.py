"""`seqpar train` on the hybrid families' tiny models with the defaults of examples/sft_tiny_usp.yaml (fused loss
on, packed rows; here 128 tokens, grad-accum 1, SGD, fp32): SP 2 (ring 2 and Ulysses 2) equals SP 1 step by step
(loss and pre-clip gradient norm within 1e-5 relative, 2 steps of one 128-token row). Ranks are threads of this
process (seqpar.threaded); `seqpar verify` of every family under torchrun (SFT and DPO, FSDP2, checkpointing, USP) is
tests/test_hf_hybrid.py::test_cli_verify_hybrids (slow suite).

One fast family per recurrence kind: LFM2 (short conv: a halo), Falcon-H1 (the Mamba2 path; its lm_head_multiplier
in the fused loss), Kimi-Linear (KDA, the gated delta rule), MiniMax (lightning attention), and Mamba (Mamba1
selective scan) under LoRA + FSDP2 (its default targets: in_proj and x_proj, the latter split over the Ulysses
channels); the other families (LFM2-MoE and LFM3 too) and modes are slow. DPO (padded pairs): LFM2 (fast) and
Mamba; LoRA (default targets) + FSDP2: one family per kind and Jamba.
"""

from __future__ import annotations

import pytest
import torch
from hf_grid import mixer_world
from recurrent_ref import patched_float64_kernels
from threaded_cases import EXAMPLE, compare_rows, train_rows

from seqpar.hf import tiny_model
from seqpar.hf.recurrent_layers import find_recurrent
from seqpar.threaded import run_threaded

TOL = 1e-5
# conv, Mamba2, KDA, lightning (the selective scan: Mamba's LoRA run below, its torch scan a loop over tokens)
FAST = ("lfm2", "falcon_h1", "kimi_linear", "minimax")
SLOW = ("mamba", "zamba2", "jamba", "falcon_mamba", "olmo_hybrid", "lfm2_moe", "lfm3")
KWARGS = {"lfm3": {"num_layers": 3, "sliding_window": 16}}  # conv, sliding (16 tokens), full attention
DATA = EXAMPLE.parent / "data"
SFT = {"grad_accum": 1, "dataset": {"path": str(DATA / "sft_small.jsonl"), "max_length": 128, "packing": True}}
DPO = {"stage": "dpo", "micro_batch_size": 2, "grad_accum": 1, "dpo": {"beta": 0.5},
       "dataset": {"path": str(DATA / "dpo_small.jsonl"), "max_length": 128, "packing": False}}
LORA_FSDP = {"grad_accum": 1, "finetuning": {"method": "lora"}, "fsdp": True,  # 64 tokens: Mamba's torch scan loops
             "dataset": {"path": str(DATA / "sft_small.jsonl"), "max_length": 64, "packing": True}}


def _sp2_equals_sp1(tmp_path, arch: str, extra: dict) -> None:
    model = {"name": f"tiny:{arch}", "kwargs": KWARGS.get(arch, {})}
    want = train_rows(tmp_path / "sp1", model, 1, 1, steps=2, checkpoint_every=0, extra=extra)
    for u, r in ((1, 2), (2, 1)):
        got = train_rows(tmp_path / f"u{u}r{r}", model, u, r, steps=2, checkpoint_every=0, extra=extra)
        compare_rows(got, want, TOL)


@pytest.mark.parametrize("arch", [*FAST, *(pytest.param(a, marks=pytest.mark.slow) for a in SLOW)])
def test_train_sft_sp2_equals_sp1(tmp_path, arch):
    _sp2_equals_sp1(tmp_path, arch, SFT)


@pytest.mark.parametrize("arch", ["lfm2", pytest.param("mamba", marks=pytest.mark.slow)])
def test_train_dpo_sp2_equals_sp1(tmp_path, arch):
    _sp2_equals_sp1(tmp_path, arch, DPO)


@pytest.mark.parametrize("arch", ["mamba", *(pytest.param(a, marks=pytest.mark.slow)
                                             for a in ("lfm2", "falcon_h1", "kimi_linear", "minimax", "jamba"))])
def test_train_lora_fsdp2_sp2_equals_sp1(tmp_path, arch):
    """LoRA with its default targets (Mamba, no attention: its mixers' in_proj / x_proj, a line says so) under
    FSDP2 (a 1-rank FSDP2 at SP 1), packed 64-token rows."""
    _sp2_equals_sp1(tmp_path, arch, LORA_FSDP)


def _lora_mixer_world(model, u: int, r: int):
    """Mamba's first mixer with LoRA on in_proj and x_proj (random A and B: real updates), SP vs its own forward on
    the whole sequence (B = 2, float64): output error and the adapters' max gradient error (summed over ranks)."""
    return mixer_world(model, u, r, keep=lambda name: "lora_" in name, relative=False)


def test_mamba1_lora_on_x_proj_is_exact():
    """Upstream's mixer calls x_proj as a module, so LoRA on it changes dt | B | C; under Ulysses seqpar applies each
    rank's channel columns of the base weight AND of the adapter's A (x_proj is linear in the channels), then sums:
    output and every adapter gradient equal the unsharded mixer's (float64, 1e-12) at Ulysses 2 and ring 2."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("mamba", dtype=torch.float64)
    torch.manual_seed(3)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj", "x_proj"],
                                             init_lora_weights=False)).base_model.model
    with patched_float64_kernels(type(model).__module__):  # the torch scan computes in fp32: its float64 loop
        results = [(u, r, run_threaded(_lora_mixer_world, 2, model, u, r, timeout=120)) for u, r in ((2, 1), (1, 2))]
    for u, r, ranks in results:
        for out_err, errs in ranks:
            assert out_err < 1e-12 and any("x_proj" in n for n in errs), (u, r, out_err, errs)
            assert all(e < 1e-12 for e in errs.values()), (u, r, errs)


def test_default_lora_targets_on_models_without_attention(capsys):
    """finetuning.targets left at the attention projections: a model that has them keeps them; Mamba (none) gets its
    mixers' in_proj / x_proj (a line says so); targets written by the user are theirs."""
    from seqpar.train.config.load import load_config
    from seqpar.train.model.load import lora_targets

    cfg = load_config(EXAMPLE, {"finetuning": {"method": "lora"}})
    assert lora_targets(tiny_model("lfm2"), cfg) == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_targets(tiny_model("mamba"), cfg) == ["in_proj", "x_proj"]
    assert "MambaForCausalLM has no attention projections" in capsys.readouterr().out
    mine = load_config(EXAMPLE, {"finetuning": {"method": "lora", "targets": ["in_proj"]}})
    assert lora_targets(tiny_model("mamba"), mine) == ["in_proj"]


def test_mamba1_x_proj_wrappers_it_cannot_split_are_refused():
    """Under Ulysses a DoRA adapter on x_proj (its norm is not linear in the channels) is refused, naming the ring."""
    from peft import LoraConfig, get_peft_model

    from seqpar.errors import SeqParError
    from seqpar.hf.mamba1 import _x_proj_share

    model = get_peft_model(tiny_model("mamba"), LoraConfig(r=4, target_modules=["x_proj"], use_dora=True))
    lin = find_recurrent(model.base_model.model)[0][0].x_proj
    d, out = lin.base_layer.in_features, lin.base_layer.out_features
    assert _x_proj_share(lin, torch.randn(1, 8, d), slice(0, d), 1).shape == (1, 8, out)  # U = 1: the module
    with pytest.raises(SeqParError, match="not plain LoRA.*ring"):
        _x_proj_share(lin, torch.randn(1, 8, d // 2), slice(0, d // 2), 2)
