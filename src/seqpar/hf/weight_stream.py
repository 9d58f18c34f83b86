"""The policy's current weights as (HF checkpoint name, full tensor) pairs, one at a time.

What an inference engine loading "by name" wants (seqpar.hf.vllm_engine): the names of the plain HF model, whatever
wraps the policy -- DDP (`module.`), FSDP2 (DTensor shards: each parameter's full tensor is gathered when its turn
comes, so at most one full tensor exists at a time; every rank of the shard group must iterate, in the same order),
DeepSpeed ZeRO-3 (the HF / TRL drop-ins: each partitioned parameter is gathered alone, by
deepspeed.zero.GatheredParameters, for the time its tensor is handed over, and partitioned again before the next:
again one full parameter at a time, every rank of the data-parallel group iterating in the same order) and PEFT
LoRA (each adapted linear's weight is yielded MERGED, W + scaling x B @ A, computed into a new tensor: the model's
own weights are never touched, so nothing has to be unmerged and no rounding creeps into the trained base; under
ZeRO-3 the weight and its adapters are gathered together). A yielded tensor is the consumer's to copy before it
asks for the next one: under ZeRO-3 it is the gathered parameter itself, which is released at the next step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import SeqParError

__all__ = ["named_full_weights"]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (an FSDP2 DTensor gathered; a ZeRO-3 one must be gathered already), detached."""
    if hasattr(t, "ds_shape") and tuple(t.shape) != tuple(t.ds_shape):  # never push a partition as a weight
        raise SeqParError(f"a DeepSpeed ZeRO-3 parameter of shape {tuple(t.ds_shape)} was not gathered for the "
                          "weight push (it holds a partition): push with seqpar.hf.weight_stream.named_full_weights")
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _partitioned(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The ZeRO-3 parameters among `params` not available in full here (persistent ones, or ones an outer gather
    holds, are left as they are: GatheredParameters refuses to gather a parameter twice)."""
    out = []
    for p in params:
        status = getattr(p, "ds_status", None)
        if status is not None and status.name == "NOT_AVAILABLE":
            out.append(p)
    return out


@contextmanager
def _gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """`params` full for the body (ZeRO-3: gathered read-only, partitioned again at exit; anything else: as is)."""
    todo = _partitioned(params)
    if not todo:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(todo, modifier_rank=None):
        yield


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


def _adapters(layer: Any) -> list[torch.nn.Parameter]:
    """A LoRA layer's active adapter weights (what _lora_delta reads)."""
    return [d[n].weight for n in layer.active_adapters for d in (layer.lora_A, layer.lora_B) if n in d]


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
            layer = lora_layers.get(owner) if leaf else None
            merge = layer is not None and leaf == "weight"
            with _gathered([p, *(_adapters(layer) if merge else [])]):  # ZeRO-3: just these, full
                full = _full(p)
                if layer is not None:
                    name = f"{owner}.{leaf}"
                    delta = _lora_delta(layer) if merge else None
                    if delta is not None:
                        full = (full.float() + delta).to(full.dtype)
                yield name, full
