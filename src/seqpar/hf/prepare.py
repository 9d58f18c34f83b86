"""One way to prepare a model for sequence-parallel training, below every trainer: `seqpar train`
(train/model/build.py), the Trainer drop-ins (hf/trainer.py) and the TRL drop-ins (trl/) all call
`prepare_model` for the policy and `frozen_reference` for a DPO / GRPO reference model, so a change to model
preparation lands once and the trainers cannot disagree on its order.

The order (each step assumes the ones before it):

1. SP attention: seqpar's attention function and, in hybrid models, the Gated DeltaNet plans
   (`apply_sequence_parallel`; a model that already has it keeps it);
2. LoRA: `seqpar train`'s adapter (the drop-ins receive a model the user or TRL already wrapped with PEFT);
3. memory features: layer checkpointing (`seqpar train`; the Trainer enables its own in train(), made
   SP-safe by hf/trainer_args.py), tiled MLP, tiled layer (docs/memory.md);
4. the fused loss head: installed now so that an architecture it cannot fuse is refused before any
   collective (it would otherwise be installed at the first fused forward);
5. the wrapper, by the stack that owns it once `prepare_model` returned: `seqpar train`'s bf16 master weights
   or FSDP2 (train/model/build.py), the Trainer's DDP / FSDP2 / DeepSpeed (accelerate, in Trainer.train()).
   The fused head and the tiles are instance-level forwards on unreplaced modules, so every wrapper keeps them.

A frozen reference goes through steps 1, 3 (tiles only, where the spec says so) and 4, in eval mode and
without gradients; the stack then places it as it places the policy (FSDP2 shards, a DeepSpeed inference
engine, or the device).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SeqParError
from ..memory.checkpointing import enable_activation_checkpointing
from ..memory.fused_loss import install_fused_head
from ..memory.tiled_compute import apply_tiled_layer, tiled_layers
from ..memory.tiled_mlp import apply_tiled_mlp, decoder_mlps
from ..mesh import SequenceParallelMesh
from .attention import apply_sequence_parallel, is_sequence_parallel

__all__ = ["PrepareSpec", "prepare_model", "frozen_reference", "policy_copy", "check_memory_features"]


@dataclass(frozen=True)
class PrepareSpec:
    """What `prepare_model` applies, the same for every trainer.

    fused_loss: the chunked lm_head + loss (no [S_local, vocab] logits); loss_chunk_tokens: its supervised
    tokens per chunk (None: one chunk's fp32 logits <= 256 MB), read by the step. activation_checkpointing /
    offload_activations: layer checkpointing with the kept inputs in host memory (seqpar train; the Trainer
    enables its own). tiled_mlp / tiled_layer: False, True (automatic tile count) or an int >= 1.
    tile_reference: the frozen reference gets the tiles too (seqpar train: a lower reference forward peak);
    the drop-ins keep it untiled, since under ZeRO-3 only the policy's tile count is agreed between ranks
    (hf/trainer_stack.agree_gathers).
    """

    fused_loss: bool = True
    loss_chunk_tokens: int | None = None
    activation_checkpointing: bool = False
    offload_activations: bool = False
    tiled_mlp: bool | int = False
    tiled_layer: bool | int = False
    tile_reference: bool = True
    attention_kernel: str = "auto"  # seqpar.attention's kernel= for every attention call (docs/gpu.md)
    attention_head_chunks: int = 1  # seqpar.attention's head_chunks= (attention.heads)
    keep_attention: bool = False  # checkpointing keeps the attention kernels' outputs (memory.checkpointing)

    def head_kwargs(self) -> dict[str, Any]:
        """The fused-head arguments of the step's reference log-probs (seqpar.steps.ReferenceLogps)."""
        return {"fused_loss": self.fused_loss, "loss_chunk_tokens": self.loss_chunk_tokens}


def check_memory_features(model: torch.nn.Module, spec: PrepareSpec) -> None:
    """The memory features `spec` asks for can run on `model`: SeqParError otherwise, before any process group
    (identically on every rank). Both offloads run on CPU-only machines too (docs/memory.md)."""
    for name, value in (("tiled_mlp", spec.tiled_mlp), ("tiled_layer", spec.tiled_layer)):
        if not isinstance(value, bool) and (not isinstance(value, int) or value < 1):
            raise SeqParError(f"{name}={value!r}: use False, True (automatic tile count) or an int >= 1")
    if not isinstance(spec.attention_head_chunks, int) or spec.attention_head_chunks < 1:
        raise SeqParError(f"attention_head_chunks={spec.attention_head_chunks!r}: use an int >= 1 (1: whole calls)")
    if spec.loss_chunk_tokens is not None and spec.loss_chunk_tokens < 1:
        raise SeqParError(f"loss_chunk_tokens must be >= 1 (or None), got {spec.loss_chunk_tokens}")
    if spec.tiled_mlp:
        decoder_mlps(model)  # raises for MLPs it cannot tile
    if spec.tiled_layer:
        tiled_layers(model)  # raises for decoder layers it cannot tile


def _tile(model: torch.nn.Module, spec: PrepareSpec) -> None:
    if spec.tiled_mlp:
        apply_tiled_mlp(model, spec.tiled_mlp)
    if spec.tiled_layer:
        apply_tiled_layer(model, spec.tiled_layer)


def prepare_model(model: torch.nn.Module, mesh: SequenceParallelMesh, spec: PrepareSpec, *,
                  lora: Callable[[torch.nn.Module], torch.nn.Module] | None = None) -> torch.nn.Module:
    """Steps 1-4 of the module docstring on the policy; returns it (`lora` may return a new wrapper).
    The stack wraps it next (step 5)."""
    if not is_sequence_parallel(model):
        apply_sequence_parallel(model, mesh, attention_kernel=spec.attention_kernel,
                                head_chunks=spec.attention_head_chunks)
    if lora is not None:
        model = lora(model)
    if spec.activation_checkpointing:
        enable_activation_checkpointing(model, offload=spec.offload_activations, keep_attention=spec.keep_attention)
    _tile(model, spec)
    if spec.fused_loss:  # refuses an architecture it cannot fuse now, identically on every rank
        install_fused_head(model)
    return model


def frozen_reference(ref: torch.nn.Module, mesh: SequenceParallelMesh, spec: PrepareSpec) -> torch.nn.Module:
    """A DPO / GRPO reference model through the policy's steps 1, 3 (tiles, if spec.tile_reference) and 4:
    eval mode, no gradients. Returns it; the stack places it (step 5) as it places the policy."""
    ref.eval().requires_grad_(False)
    if not is_sequence_parallel(ref):
        apply_sequence_parallel(ref, mesh, attention_kernel=spec.attention_kernel,
                                head_chunks=spec.attention_head_chunks)
    if spec.tile_reference:
        _tile(ref, spec)
    if spec.fused_loss:
        install_fused_head(ref)
    return ref


def policy_copy(policy: torch.nn.Module, who: str) -> torch.nn.Module:
    """A copy of the policy, taken before training, to be the frozen reference (SP not applied yet: a model
    with SP refuses to be copied, as the copy would share its attention registration)."""
    if is_sequence_parallel(policy):
        raise SeqParError(f"{who}: the policy already has SP applied, so it cannot be copied as the reference: "
                          "pass ref_model=")
    return copy.deepcopy(policy)
