"""Finding the Hugging Face model inside its wrappers: one helper for every layer that patches models.

`base_model` returns the transformers PreTrainedModel inside PEFT wrappers (FSDP2 keeps the module
itself); `decoder_layers` lists its decoder layers in order. `BATCH_INPUTS_HOOK` names the
attribute through which a model patched by `seqpar.hf.apply_sequence_parallel` tells the step code
(`seqpar.steps`, a lower layer) how to turn a batch that needs the model -- a vision-language batch --
into keyword arguments, so the step code never imports the HF adapter.
"""

from __future__ import annotations

import torch

__all__ = ["base_model", "unwrapped_base", "decoder_layers", "vision_blocks", "BATCH_INPUTS_HOOK"]

# On the base model: callable(model, batch, device) -> model kwargs, set by apply_sequence_parallel for
# models whose batches cannot be sharded without the model (Qwen VL: image encoding, multimodal RoPE).
BATCH_INPUTS_HOOK = "_seqpar_batch_inputs"


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside (PEFT wrappers included; DDP is unwrapped by its callers)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def unwrapped_base(model: torch.nn.Module) -> torch.nn.Module:
    """base_model of what DDP / a DeepSpeed engine wraps (their `.module`), for code handed the wrapped model."""
    while type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine") and isinstance(
            getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return base_model(model)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers (transformers' *DecoderLayer modules), in forward order."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def vision_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision tower's transformer blocks of a vision-language model (transformers' *VisionBlock), in order."""
    return [m for m in model.modules() if type(m).__name__.endswith("VisionBlock")]
