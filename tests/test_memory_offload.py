"""Activation offload (seqpar.memory.offload) and FSDP2 CPU offload: exact, and measured, on CPU.

Exactness: with offload the loss and every gradient equal those of checkpointing without offload within
1e-6 (fp32; the bytes are copied bit for bit, so in practice they are identical) and the independent
plain-HF reference within 1e-5 (tests/test_memory_features.py's harness: Ulysses, ring, USP, dp x ring
under FSDP2, LoRA, DPO with the LoRA policy as its own reference, packed and padded rows). `seqpar train`
(SFT with LoRA + FSDP2 + fsdp.offload, GRPO) with offload vs without: per-step losses and the final
parameters within 1e-6. The HF Trainer drop-in with gradient_checkpointing_kwargs={"offload": True} vs the
stock Trainer without checkpointing, SGD: per-step losses, gradient norms and final parameters within 1e-5.

Memory: the exact meter's device peak drops by the offloaded layer inputs, which it reports separately as
host bytes (the same check fails without offload: nothing offloaded, no drop).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from procs import SFT_ROWS_SCRIPT, check_same_training, plain_and_sp
from test_memory_features import HEADS, VOCAB, _assert_results, world_cases

from seqpar.hf import tiny_model
from seqpar.memory.checkpointing import enable_activation_checkpointing
from seqpar.memory.meter import PeakMemoryMeter
from seqpar.memory.offload import offload_store, remove_activation_offload
from seqpar.spawn import run_distributed

SELF_TOL = 1e-6
OFF = {"ckpt": True, "offload": True}
LAYERS, HIDDEN, S = 4, 32, 512


def _step(offload: bool, frozen: bool = False) -> tuple[float, dict, dict, object]:
    """One fp32 SFT step of a 4-layer tiny llama, measured. frozen: only layer 0's q_proj trains (as with
    LoRA, parameter gradients do not grow during backward, so every layer's recompute has the same
    working set and the device peak is the first recompute in both runs: the comparison is like for like)."""
    m = tiny_model("llama", *HEADS, vocab_size=VOCAB, seed=0, num_layers=LAYERS)
    if frozen:
        for name, p in m.named_parameters():
            p.requires_grad_(name == "model.layers.0.self_attn.q_proj.weight")
    enable_activation_checkpointing(m, offload=offload)
    m.train()
    ids = torch.randint(3, VOCAB, (1, S), generator=torch.Generator().manual_seed(0))
    meter = PeakMemoryMeter(m)
    with meter.measure() if frozen else contextlib.nullcontext():  # the exactness runs need no meter
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return float(out.loss.detach()), grads, meter.last, m


def test_offload_exact_and_meter_reports_device_and_host_bytes():
    """Fast guard (SP=1, in process): identical loss and gradients; every layer input went to the host
    store; the device peak is lower by at least all but one layer input, and the host bytes are reported."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loss0, g0, _, _ = _step(False)
        loss1, g1, _, _ = _step(True)
        _, _, r0, _ = _step(False, frozen=True)
        _, _, r1, m = _step(True, frozen=True)
    finally:
        torch.set_num_threads(n)
    assert abs(loss1 - loss0) <= SELF_TOL
    assert g0.keys() == g1.keys() and len(g0) == len(list(m.parameters()))
    assert max(float((g1[k] - g0[k]).abs().max()) for k in g0) <= SELF_TOL
    layer_input = S * HIDDEN * 4
    store = offload_store(m)
    assert store.packed_tensors == LAYERS and store.packed_bytes == LAYERS * layer_input
    assert store.current_bytes == 0  # freed with the graph
    assert r1["offloaded_peak_bytes"] == LAYERS * layer_input and r0["offloaded_peak_bytes"] == 0
    assert r0["offloaded_at_peak_bytes"] == 0 and r1["offloaded_at_peak_bytes"] > 0
    # device bytes: the layer inputs are no longer counted, except the one being recomputed
    assert r0["peak_bytes"] - r1["peak_bytes"] >= (LAYERS - 1) * layer_input, (r0["peak_bytes"], r1["peak_bytes"])
    # what left the device is what the store holds at the device peak, not more
    assert r0["peak_bytes"] - r1["peak_bytes"] <= r1["offloaded_at_peak_bytes"]
    remove_activation_offload(m)
    assert offload_store(m) is None


@pytest.mark.slow
def test_offload_bf16_batch_of_two_bit_identical():
    """bf16 (stored as raw bytes: numpy has no bf16), B = 2: loss and gradients bit-identical."""
    def run(offload: bool) -> tuple[torch.Tensor, dict]:
        m = tiny_model("llama", *HEADS, vocab_size=VOCAB, seed=0).to(torch.bfloat16)
        enable_activation_checkpointing(m, offload=offload)
        m.train()
        ids = torch.randint(3, VOCAB, (2, 100), generator=torch.Generator().manual_seed(1))
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        assert (offload_store(m) is not None) == offload
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    (l0, g0), (l1, g1) = run(False), run(True)
    assert torch.equal(l0, l1) and all(torch.equal(g0[k], g1[k]) for k in g0)


# ----------------------------------------------------------------------------- multi-rank exactness
W2 = [
    ("ulysses2", "llama", "packed", OFF, {}),
    ("ring2", "qwen3", "pad", {**OFF, "tiles": 2}, {}),
    ("ring2", "gemma3", "dpo", OFF, {"lora": True}),
    ("ulysses2", "phi3", "pad", OFF, {"lora": True}),
]
W4 = [
    ("usp2x2", "llama", "pad", OFF, {}),
    ("usp2x2", "qwen2", "dpo", {**OFF, "tiles": 2}, {"lora": True}),
    ("dp2xring2", "mistral", "packed", OFF, {"fsdp": True, "lora": True}),
    ("dp2xulysses2", "gemma2", "pad", {**OFF, "tiles": True}, {"fsdp": True}),
]


def _offload_exact(world: int, cases: list) -> None:
    res = run_distributed(world_cases, world, cases, timeout=540)
    _assert_results(res)
    for rank in res:
        for key, r in rank:
            assert r["offloaded"] >= 2, (key, r)  # both layers' inputs went through the store


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [(2, W2), (4, W4)], ids=["world2", "world4"])
def test_offload_exact_every_sp_mode(world, cases):
    """Offload vs checkpointing alone (1e-6) and vs the plain-HF reference (1e-5): Ulysses, ring, USP,
    dp x SP under FSDP2, LoRA, SFT and DPO, with and without tiled MLP; the layer inputs were offloaded."""
    _offload_exact(world, cases)


def test_offload_exact_world2_fast():
    """Fast twin of the grid above (SP=1 in process is the only other fast offload test): on 2 ranks, a zigzag
    ring with tiled MLP (SFT, padded rows) and Ulysses with LoRA (DPO, the LoRA policy as its own reference):
    loss and every gradient vs checkpointing alone (1e-6) and vs the plain-HF reference (1e-5)."""
    _offload_exact(2, [W2[1], ("ulysses2", "phi3", "dpo", OFF, {"lora": True})])


# ----------------------------------------------------------------------------- seqpar train (LoRA + FSDP2, GRPO)
def _train_world(cases: list[tuple[str, dict]]) -> dict:
    from seqpar.train.config import config_from_dict
    from seqpar.train.run import train

    out = {}
    for name, c in cases:
        res = train(config_from_dict(c))
        out[name] = {"losses": res.losses, "state": res.final_state_path,
                     "offloaded": max((r or {}).get("offloaded_peak_bytes", 0) for r in res.peak_alloc or [{}])}
    return out


def _sft_cfg(tmp_path: Path, name: str, offload: bool) -> dict:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"instruction": " ".join(words[i:i + 3]), "response": " ".join(words[i:])})
                                + "\n" for i in range(8)))
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "num_layers": 2}},
        "dataset": {"path": str(data), "max_length": 64, "packing": True},
        "finetuning": {"method": "lora", "r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
        "sequence_parallel": {"size": 2, "ring_degree": 2}, "fsdp": {"enabled": True, "offload": offload},
        "memory": {"activation_checkpointing": True, "offload_activations": offload, "measure": True},
        "micro_batch_size": 1, "grad_accum": 2, "max_steps": 2, "optimizer": {"name": "sgd", "lr": 0.5},
        "output_dir": str(tmp_path / name), "progress": False, "seed": 0, "checkpoint": {"save_final": True},
        "export": {"final": False},
    }


def _grpo_cfg(tmp_path: Path, name: str, offload: bool) -> dict:
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": p, "answer": "a"}) + "\n"
                                for p in ("alpha beta", "gamma", "delta epsilon zeta", "eta")))
    return {
        "model": {"name": "tiny:llama", "kwargs": {"num_heads": 4, "num_kv_heads": 2}},
        "dataset": {"path": str(data), "max_length": 48}, "stage": "grpo",
        "sequence_parallel": {"size": 2, "ulysses_degree": 2},
        "micro_batch_size": 2, "grad_accum": 1, "max_steps": 1, "seed": 3, "output_dir": str(tmp_path / name),
        "optimizer": {"name": "sgd", "lr": 0.5}, "checkpoint": {"save_final": True}, "progress": False,
        "export": {"final": False},
        "memory": {"activation_checkpointing": True, "offload_activations": offload, "measure": True},
        "grpo": {"reward_funcs": ["seqpar:length"], "num_generations": 2, "max_prompt_length": 24,
                 "max_completion_length": 8, "temperature": 0.7, "beta": 0.04},
    }


@pytest.mark.slow
def test_seqpar_train_offload_lora_fsdp2_and_grpo(tmp_path):
    """`seqpar train` on a ring / Ulysses of 2: SFT with LoRA + FSDP2 (+ fsdp.offload on CPU), and GRPO;
    with activation offload vs without: per-step losses and final parameters within 1e-6."""
    cases = [(f"{kind}_{off}", cfg(tmp_path, f"{kind}_{off}", off))
             for kind, cfg in (("sft", _sft_cfg), ("grpo", _grpo_cfg)) for off in (False, True)]
    res = run_distributed(_train_world, 2, cases, timeout=540)[0]
    for kind in ("sft", "grpo"):
        a, b = res[f"{kind}_False"], res[f"{kind}_True"]
        assert a["offloaded"] == 0 and b["offloaded"] > 0, (kind, a["offloaded"], b["offloaded"])
        assert len(a["losses"]) == len(b["losses"]) >= 1
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= SELF_TOL, (kind, a, b)
        sa, sb = torch.load(a["state"]), torch.load(b["state"])
        assert sa.keys() == sb.keys()
        diff = max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)
        assert diff <= SELF_TOL, (kind, diff)
    # the steps moved the LoRA adapters (lora_B starts at 0): the state comparison is not vacuous
    lora_b = {k: v for k, v in torch.load(res["sft_True"]["state"]).items() if "lora_B" in k}
    assert lora_b and max(float(v.abs().max()) for v in lora_b.values()) > 1e-4


# ----------------------------------------------------------------------------- the HF Trainer drop-in
HF_SCRIPT = r'''
import json, sys
import torch, datasets
from transformers import Trainer, TrainingArguments
from seqpar.hf import tiny_model
from seqpar.hf.trainer import SequenceParallelTrainer
from seqpar.memory.offload import offload_store

mode, out = sys.argv[1], sys.argv[2]
''' + SFT_ROWS_SCRIPT + r'''
args = TrainingArguments(output_dir=f"{out}/o", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=2, optim="sgd", learning_rate=0.1, max_grad_norm=1.0, logging_steps=1,
                         report_to=[], save_strategy="no",
                         train_sampling_strategy="sequential", use_cpu=True, seed=0, disable_tqdm=True,
                         gradient_checkpointing=(mode == "sp"),
                         gradient_checkpointing_kwargs={"offload": True} if mode == "sp" else None)
model = tiny_model("llama", 3, 1, vocab_size=64, seed=0)
if mode == "sp":
    t = SequenceParallelTrainer(model=model, args=args, train_dataset=ds)  # seqpar collates
else:
    t = Trainer(model=model, args=args, train_dataset=ds, data_collator=pad_collate)
t.train()
store = offload_store(model)
res = {"losses": [h["loss"] for h in t.state.log_history if "loss" in h],
       "grad_norms": [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h],
       "packed": store.packed_tensors if store is not None else 0}
if t.is_world_process_zero():
    torch.save({k: v.detach() for k, v in model.named_parameters()}, f"{out}/params.pt")
    json.dump(res, open(f"{out}/result.json", "w"))
'''


@pytest.mark.slow
def test_hf_trainer_dropin_offload(tmp_path):
    """SequenceParallelTrainer(gradient_checkpointing_kwargs={"offload": True}) on a ring of 2 vs the stock
    Trainer without checkpointing, SGD: per-step losses, gradient norms and the final parameters within 1e-5;
    layer inputs went through the host store."""
    plain, sp = plain_and_sp(HF_SCRIPT, tmp_path)
    assert plain["packed"] == 0 and sp["packed"] >= 2 * 2 * 2  # 2 layers x 2 micro-batches x 2 steps
    init = dict(tiny_model("llama", 3, 1, vocab_size=64, seed=0).named_parameters())
    check_same_training(tmp_path, plain, sp, 2, init)
