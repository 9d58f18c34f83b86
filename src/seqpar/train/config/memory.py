"""The memory sections of a run's config: `memory:` (the long-context memory features) and `fsdp:`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .base import StrictModel as _Strict

__all__ = ["MemorySpec", "FSDPSpec"]


class MemorySpec(_Strict):
    """Long-context memory features (docs/memory.md). Each keeps the loss and gradients exact.

    activation_checkpointing: recompute each decoder layer in backward (non-reentrant); only layer
      inputs stay alive between forward and backward.
    offload_activations: with activation_checkpointing, keep those layer inputs in host memory
      (seqpar.memory.offload: pinned buffers + side-stream copies on accelerators; on CPU a host store the
      meter reports apart from the device bytes). Exact.
    fused_loss: lm_head + loss over chunks of tokens, so no [S_local, vocab] logits tensor exists.
    loss_chunk_tokens: tokens per loss chunk; None = as many as keep one chunk's fp32 logits <= 256 MB.
    tiled_mlp: run each decoder MLP over sequence tiles, recomputing tile by tile in backward;
      true = tile count from the shapes, an int = that many tiles.
    tiled_layer: run the rest of each decoder layer (norms, q/k/v/o projections, RoPE, residual adds, MLP)
      over sequence tiles, recomputed tile by tile (seqpar.memory.tiled_compute); values as tiled_mlp.
    attention_head_chunks: run every attention kernel call over this many groups of heads, one after another
      (seqpar.attention.heads): on a GPU the kernels' backward workspace exists for one group at a time
      (`seqpar plan` says when it pays); exact for any value.
    keep_attention: with activation_checkpointing, the recompute reuses the attention kernels' forward outputs
      instead of running them again (torch's selective checkpointing): one attention forward per layer less per
      step, the kernels' out and lse (per layer and token: e q + 4 heads bytes, x the calls a query row is in)
      kept until the layer's backward. Exact.
    measure: exact per-rank peak of live tensor bytes per step (seqpar.memory.meter), logged as
      peak_alloc_mb (max over ranks); it costs Python work per op, so set false for timing runs.
    """

    activation_checkpointing: bool = False
    offload_activations: bool = False
    fused_loss: bool = True
    loss_chunk_tokens: int | None = Field(default=None, ge=1)
    tiled_mlp: bool | int = False
    tiled_layer: bool | int = False
    attention_head_chunks: int = Field(default=1, ge=1)
    keep_attention: bool = False
    measure: bool = True

    @field_validator("tiled_mlp", "tiled_layer")
    @classmethod
    def _tiles(cls, v: bool | int, info: Any) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"memory.{info.field_name}={v}: use true (automatic tile count), false, or a tile "
                             "count >= 1")
        return v

    @model_validator(mode="after")
    def _offload_needs_ckpt(self) -> MemorySpec:
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                "memory.offload_activations offloads the checkpointed layer inputs: also set "
                "memory.activation_checkpointing: true"
            )
        if self.keep_attention and not self.activation_checkpointing:
            raise ValueError("memory.keep_attention keeps attention's outputs through checkpointing: also set "
                             "memory.activation_checkpointing: true")
        return self


class FSDPSpec(_Strict):
    """`fsdp: true` or `fsdp: {enabled: true, offload: true}`; truthy when enabled.

    offload: parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy; on a CPU-only
      run it is host to host, unpinned: exact, no memory effect).
    """

    enabled: bool = False
    offload: bool = False

    def __bool__(self) -> bool:
        return self.enabled
