"""A vision-language model's images in a generate() under FSDP2: every rank runs the vision tower once per call.

transformers' generate() encodes a VL model's images before the prefill, outside the model's forward: under
FSDP2 that runs the tower on sharded parameters outside the root unit's gather (a collective the other ranks
never enter). `media_encoded_in_forward` declares the model text-only for the call, which leaves the encoding to
the prefill forward, inside the root unit.

Where the vision blocks are FSDP2 units of their own (transformers' _no_split_modules, as accelerate wraps a
Qwen-VL model), each block's forward all-gathers its weights: every rank must run the tower in the same
generate() step. A rank whose rows carry images runs it in its prefill (Qwen-VL: after the token embedding,
before the language model); `vision_tower_joined` makes a rank without images run it on one blank image at the
same point (a pre-hook on the language model, once), its output dropped. Later decoding steps run no tower on
any rank (the images are consumed by the prefill; synced_gpus' extra steps carry none), so every rank issues the
same gathers in the same order. Images stay on the rank that samples their rows: no media travel between ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import SeqParError
from ..unwrap import base_model as _base_model
from .vision_encode import blank_tower_pass

__all__ = ["media_encoded_in_forward", "vision_tower_joined"]


@contextlib.contextmanager
def media_encoded_in_forward(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """The model declared text-only for the block (see the module docstring): its images are encoded in the
    prefill forward, not before it."""
    base = _base_model(model)
    if not on or "input_modalities" in base.__dict__:
        yield
        return
    base.input_modalities = ("text",)
    try:
        yield
    finally:
        del base.input_modalities


def _vlm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module holding the tower and get_image_features, its language model) of a Qwen-VL style model."""
    base = _base_model(model)
    for vlm in (getattr(base, "model", None), base):
        if vlm is not None and hasattr(vlm, "visual") and hasattr(vlm, "language_model"):
            return vlm, vlm.language_model
    raise SeqParError(f"{type(base).__name__} has no vision tower + language model pair (visual / language_model): "
                      "image prompts under FSDP2 need a Qwen-VL style model")


@contextlib.contextmanager
def vision_tower_joined(model: torch.nn.Module, has_media: bool) -> Iterator[None]:
    """One generate() of an FSDP2-sharded VL model: images encoded in the prefill forward and, where this rank's
    rows carry none (`has_media` False), the tower run once on a blank image where an image would run (see the
    module docstring). A model without FSDP2 units passes through unchanged."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        yield
        return
    vlm, lm = _vlm_parts(model)
    handles: list[Any] = []

    def join(module: torch.nn.Module, args: Any) -> None:
        handles.pop().remove()  # the prefill only
        blank_tower_pass(vlm)

    with media_encoded_in_forward(model, True):
        if not has_media:
            handles.append(lm.register_forward_pre_hook(join))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
