"""The parts of the vLLM rollout engine that run without vLLM (the main environment).

seqpar.hf.weight_stream.named_full_weights, what the engine is fed before every rollout.

Plain model: every parameter under its state_dict name, the same values. LoRA (peft): the adapted linears'
weights merged (W + scaling x B @ A) equal peft's own merge_and_unload() within 1e-6 (fp32), adapter tensors not
yielded under their own names, and the trained model's tensors untouched (bitwise). FSDP2 on 2 threaded ranks:
each parameter's full tensor equals the unsharded model's (exact). Plus the one-line refusal of engine: vllm where
vLLM is not installed (the main environment), and rollouts.jsonl trimmed for a resume."""

from __future__ import annotations

import copy

import pytest
import torch

from seqpar.hf.models import tiny_model
from seqpar.hf.weight_stream import named_full_weights


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=8).float()


def test_plain_names_and_values():
    m = _model()
    got = dict(named_full_weights(m))
    want = dict(m.named_parameters())
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_lora_merged_without_touching_the_model():
    from peft import LoraConfig, get_peft_model

    base = _model()
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # B starts at 0: a real delta
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    got = dict(named_full_weights(pm))
    merged = dict(copy.deepcopy(pm).merge_and_unload().named_parameters())
    assert list(got) == list(merged)
    assert not any("lora" in k or "base_layer" in k for k in got)
    worst = max(float((got[k] - merged[k]).abs().max()) for k in merged)
    assert worst < 1e-6, worst
    moved = float((got["model.layers.0.self_attn.q_proj.weight"]
                   - before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]).abs().max())
    assert moved > 1e-3  # the delta is in what is pushed
    assert all(torch.equal(v, before[k]) for k, v in pm.state_dict().items())


def _fsdp_rank(full: dict) -> bool:
    from seqpar.train.model.build import apply_fsdp

    m = tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=8).float()
    m.load_state_dict(full)  # (the global RNG is shared by the threads: the values come from the caller)
    apply_fsdp(m, torch.device("cpu"), 2, bf16=False)
    assert any(hasattr(p, "full_tensor") for p in m.parameters())  # sharded: DTensors
    got = dict(named_full_weights(m))
    assert list(got) == list(full)
    return all(torch.equal(got[k], full[k]) for k in full)


def test_fsdp2_full_tensors():
    from seqpar.threaded import run_threaded

    full = {k: v.detach().clone() for k, v in _model().named_parameters()}
    assert run_threaded(_fsdp_rank, 2, full, timeout=120) == [True, True]


def test_vllm_engine_needs_vllm(monkeypatch):
    from seqpar.errors import SeqParError
    from seqpar.hf import vllm_models
    from seqpar.train.config import config_from_dict
    from seqpar.train.grpo.engine import check_rollout_engine

    monkeypatch.setattr(vllm_models, "vllm_available", lambda: False)  # as in the main environment
    cfg = config_from_dict({"model": {"name": "tiny:llama"}, "dataset": {"path": "x.jsonl", "max_length": 64},
                            "stage": "grpo", "output_dir": "o", "micro_batch_size": 2,
                            "grpo": {"reward_funcs": ["seqpar:length"], "num_generations": 2, "max_prompt_length": 16,
                                     "max_completion_length": 8, "rollout": {"engine": "vllm"}}})
    with pytest.raises(SeqParError) as e:
        check_rollout_engine(cfg, _model().config, 1)
    assert "make vllm-env" in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_resolves_to_the_sp_size_or_1():
    from seqpar.errors import SeqParError
    from seqpar.train.config.rollout import RolloutSpec, resolve_tensor_parallel

    assert RolloutSpec().tensor_parallel == "sp"  # default: one engine per SP group
    assert [resolve_tensor_parallel(RolloutSpec(), sp) for sp in (1, 2, 3)] == [1, 2, 3]
    assert resolve_tensor_parallel(RolloutSpec(tensor_parallel=1), 4) == 1
    assert resolve_tensor_parallel(RolloutSpec(tensor_parallel=4), 4) == 4
    with pytest.raises(SeqParError, match="tensor_parallel=2 with sequence_parallel size 4: .* sp \\(= 4\\) or 1"):
        resolve_tensor_parallel(RolloutSpec(tensor_parallel=2), 4)
    with pytest.raises(ValueError, match="tensor_parallel=0"):
        RolloutSpec(tensor_parallel=0)


@pytest.mark.parametrize("heads,kv,inter,tp,bad", [
    (4, 2, 64, 2, None), (4, 1, 64, 4, None), (4, 2, 64, 4, None),  # KV heads split, or replicated (tp % kv == 0)
    (3, 1, 64, 2, "num_attention_heads=3"), (6, 4, 64, 3, "num_key_value_heads=4"),
    (4, 4, 66, 4, "intermediate_size=66"),
])
def test_tensor_parallel_needs_splittable_sizes(heads, kv, inter, tp, bad):
    from types import SimpleNamespace

    from seqpar.errors import SeqParError
    from seqpar.hf.vllm_models import check_tensor_parallel

    c = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter)
    if bad is None:
        check_tensor_parallel(c, tp)
        return
    with pytest.raises(SeqParError, match=f"cannot split the model's {bad} over {tp} ranks"):
        check_tensor_parallel(c, tp)


def test_trim_rollouts(tmp_path):
    import json

    from seqpar.train.grpo.engine import trim_rollouts

    p = tmp_path / "rollouts.jsonl"
    p.write_text("".join(json.dumps({"step": s, "completion_ids": [s]}) + "\n" for s in (1, 1, 2, 3)))
    trim_rollouts(p, 2)  # a resume from checkpoint-2: step 3's row is redone
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 1, 2]
    trim_rollouts(p, 0)  # a fresh start
    assert not p.exists()



def test_trl_row_seeds_follow_the_row_position():
    """The TRL drop-in's use_vllm seeds: row r of the step's generation batch is generation r % G of prompt r // G,
    seeded as `seqpar train` seeds that prompt position (local_rows with the global prompt index): the same seeds at
    any dp size (dp rank d holds rows d x n ... of the batch), different ones at the next step."""
    from seqpar.hf.generation import local_rows
    from seqpar.hf.vllm_rollout import trl_row_seeds

    one = trl_row_seeds(8, 2, seed=9, step=3, dp_rank=0)
    assert trl_row_seeds(4, 2, 9, 3, 0) + trl_row_seeds(4, 2, 9, 3, 1) == one
    assert sum((trl_row_seeds(2, 2, 9, 3, d) for d in range(4)), []) == one
    _, train_seeds = local_rows([[1]] * 4, range(4), 2, 9, 3, dp_rank=0, prompt_index=[0, 1, 2, 3])
    assert train_seeds == one
    assert len(set(one)) == 8 and set(one).isdisjoint(trl_row_seeds(8, 2, 9, 4, 0))
