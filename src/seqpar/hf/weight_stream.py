"""The policy's current weights as (HF checkpoint name, full tensor) pairs, one at a time.

What an inference engine loading "by name" wants (seqpar.hf.vllm_engine): the names of the plain HF model, whatever
wraps the policy -- DDP (`module.`), FSDP2 (DTensor shards: each parameter's full tensor is gathered when its turn
comes, so at most one full tensor exists at a time; every rank of the shard group must iterate, in the same order)
and PEFT LoRA (each adapted linear's weight is yielded MERGED, W + scaling x B @ A, computed into a new tensor: the
model's own weights are never touched, so nothing has to be unmerged and no rounding creeps into the trained base).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import SeqParError

__all__ = ["named_full_weights"]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (an FSDP2 DTensor gathered), detached."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    m = getattr(model, "module", model)  # DDP
    if hasattr(m, "get_base_model"):  # PEFT
        m = m.get_base_model()
    return m


def _lora_delta(layer: Any) -> torch.Tensor:
    """scaling x B @ A summed over the layer's active adapters ([out, in]; transposed for fan_in_fan_out)."""
    delta = None
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(name):
            raise SeqParError("LoRA with DoRA cannot be pushed to the vLLM engine yet: use plain LoRA or "
                              "engine: transformers")
        a, b = _full(layer.lora_A[name].weight), _full(layer.lora_B[name].weight)
        d = (b.float() @ a.float()) * float(layer.scaling[name])
        delta = d if delta is None else delta + d
    if delta is not None and getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    return delta


def named_full_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the policy under its HF checkpoint name, full (see the module docstring); LoRA
    adapter tensors are folded into their layer's weight, not yielded."""
    base = _hf_model(model)
    lora_layers = {n: m for n, m in base.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
    with torch.no_grad():
        for name, p in base.named_parameters():
            if ".lora_" in name or ".lora_magnitude_vector" in name:
                continue
            owner, _, leaf = name.rpartition(".base_layer.")
            full = _full(p)
            if leaf and owner in lora_layers:
                name = f"{owner}.{leaf}"
                if leaf == "weight":
                    delta = _lora_delta(lora_layers[owner])
                    if delta is not None:
                        full = (full.float() + delta).to(full.dtype)
            yield name, full
