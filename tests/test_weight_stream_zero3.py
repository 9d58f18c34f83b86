"""seqpar.hf.weight_stream.named_full_weights under DeepSpeed ZeRO-3 (the HF / TRL drop-ins' sharding), 2 ranks.

Each rank wraps the same tiny Llama (fp32) in a ZeRO-3 engine (every parameter partitioned:
stage3_param_persistence_threshold 0) and streams its weights into a dict, as the vLLM engine's push would.
- Every tensor equals the unsharded model's (plain: exact; LoRA: peft's merge_and_unload() of the unsharded model
  within 1e-6, adapters folded in, none yielded under their own names), names in state_dict order, on both ranks.
- Memory: at each yielded tensor the parameters held in full on the rank are that one parameter (plus, for a LoRA
  linear's weight, its own A / B) and nothing else: at most one parameter's worth is gathered at a time (counted in
  elements); every parameter is partitioned again after the push, and the engine's partitions are untouched.
"""

from __future__ import annotations

import copy

import torch

from seqpar.spawn import run_distributed

LORA_TOL = 1e-6


def _model(lora: bool) -> torch.nn.Module:
    from seqpar.hf.models import tiny_model

    torch.manual_seed(0)
    m = tiny_model("llama", num_heads=4, num_kv_heads=2, head_dim=8).float()
    if not lora:
        return m
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # B starts at 0: a real delta
    return pm


def _gathered(model: torch.nn.Module) -> dict[str, int]:
    """The parameters this rank holds in full now (name -> elements)."""
    return {n: p.ds_numel for n, p in model.named_parameters() if p.ds_status.name != "NOT_AVAILABLE"}


def _allowed(param_name: str, pushed: str) -> bool:
    """Whether the model's parameter `param_name` may be full while `pushed` (an HF name) is handed over: it is
    that weight, or (LoRA) one of the adapters merged into it."""
    n = param_name.removeprefix("base_model.model.")
    if ".lora_" in n:
        return pushed == n.split(".lora_")[0] + ".weight"
    return n.replace(".base_layer.", ".") == pushed


def _stream(lora: bool) -> dict:
    import deepspeed

    from seqpar.hf.weight_stream import named_full_weights

    model = _model(lora)
    want = dict((copy.deepcopy(model).merge_and_unload() if lora else model).named_parameters())
    want = {k: v.detach().clone() for k, v in want.items()}
    groups: dict[str, int] = {}  # HF name -> elements of it and its adapters: what one push step may hold
    for n, p in model.named_parameters():
        for k in want:
            groups[k] = groups.get(k, 0) + (p.numel() if _allowed(n, k) else 0)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # every parameter partitioned
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=ds)
    mod = engine.module
    assert all(p.numel() == 0 for p in mod.parameters())  # sharded: no rank holds any full parameter
    parts = {n: p.ds_tensor.clone() for n, p in mod.named_parameters()}
    got, extra, most = {}, [], 0
    for name, t in named_full_weights(engine):
        held = _gathered(mod)
        extra += [(name, n) for n in held if not _allowed(n, name)]
        most = max(most, sum(held.values()))
        got[name] = t.clone()
    assert not _gathered(mod), _gathered(mod)  # all partitioned again
    assert all(torch.equal(parts[n], p.ds_tensor) for n, p in mod.named_parameters())
    return {"names": list(got) == list(want), "lora_named": any("lora" in k or "base_layer" in k for k in got),
            "worst": max(float((got[k] - want[k]).abs().max()) for k in want), "extra": extra, "most": most,
            "bound": max(groups.values()), "total": sum(v.numel() for v in want.values())}


def _both() -> list[dict]:
    return [_stream(False), _stream(True)]


def test_zero3_streams_one_parameter_at_a_time():
    ranks = run_distributed(_both, 2, timeout=240)
    for plain, lora in ranks:
        for r, tol in ((plain, 0.0), (lora, LORA_TOL)):
            assert r["names"] and not r["lora_named"]
            assert r["worst"] <= tol, r["worst"]
            assert not r["extra"], r["extra"]  # nothing but the yielded parameter (and its adapters) was full
            assert 0 < r["most"] <= r["bound"] < r["total"] / 4, r
