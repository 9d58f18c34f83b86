"""The model as a step trains it: seqpar.hf.prepare_model (SP attention, LoRA, the memory features, the fused
head, in that order: docs/memory.md), then this run's wrapper (FSDP2 or bf16 master weights); and the reference
log-probs DPO / GRPO need (a frozen copy through seqpar.hf.frozen_reference, or the policy without its adapter).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ...hf.prepare import PrepareSpec, frozen_reference, policy_copy, prepare_model
from ...hf.prepare import check_memory_features as check_model_memory
from ...memory.sharding import shard_over_world
from ...steps import ReferenceLogps, ReferenceTokenLogps
from ...threaded import serial
from ..config import TrainConfig
from .load import apply_lora
from .precision import MasterWeights

__all__ = ["build_model", "prepare_spec", "build_reference", "check_memory_features", "apply_fsdp", "shard_reference"]


def prepare_spec(cfg: TrainConfig) -> PrepareSpec:
    """The run's model preparation (seqpar.hf.prepare), from its memory settings."""
    m = cfg.memory
    return PrepareSpec(fused_loss=m.fused_loss, loss_chunk_tokens=m.loss_chunk_tokens, tiled_mlp=m.tiled_mlp,
                       tiled_layer=m.tiled_layer, activation_checkpointing=m.activation_checkpointing,
                       offload_activations=m.offload_activations, tile_reference=True,
                       attention_kernel=cfg.attention_kernel, attention_head_chunks=m.attention_head_chunks,
                       keep_attention=m.keep_attention)


def build_model(cfg: TrainConfig, model: torch.nn.Module, mesh: Any, device: torch.device,
                world: int) -> tuple[torch.nn.Module, Any, MasterWeights | None]:
    """The policy through seqpar.hf.prepare_model (SP attention, LoRA, memory features, the fused head; then
    this run's wrapper: FSDP2, or the fp32 master weights of bf16 mixed precision without FSDP); the DPO / GRPO
    reference when the stage needs one (a frozen copy through frozen_reference, sharded like the policy)."""
    lora = cfg.finetuning.method == "lora"
    needs_ref = (cfg.stage == "dpo" and cfg.dpo.loss_type != "simpo") or (cfg.stage == "grpo" and cfg.grpo.beta > 0)
    # bf16: fp32 master weights + bf16 compute: with FSDP2 its MixedPrecisionPolicy (fp32 gradient
    # reduction), without FSDP MasterWeights (model/precision.py: taken from the fp32 weights, then the
    # model is cast to bf16 in _wrap). bf16-pure: the weights themselves are bf16. Not autocast: under
    # autocast RoPE promotes q/k to fp32 while v stays bf16, and the SP attention requires one dtype.
    model.to(device=device, dtype=torch.bfloat16 if cfg.precision == "bf16-pure" else None)
    spec = prepare_spec(cfg)
    ref_model = None
    if needs_ref and not lora:  # LoRA: the reference is the policy with its adapter disabled
        ref_model = policy_copy(model, "the DPO / GRPO reference")
        if cfg.precision != "fp32":
            ref_model.to(torch.bfloat16)
        frozen_reference(ref_model, mesh, spec)
    model = prepare_model(model, mesh, spec, lora=(lambda m: _seeded_lora(m, cfg)) if lora else None)
    prec = _wrap(cfg, model, device, world)
    if cfg.fsdp and ref_model is not None:
        shard_reference(cfg, ref_model, device, world)
    reference = build_reference(cfg, mesh, ref_model, model) if needs_ref else None
    return model, reference, prec


def _seeded_lora(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    with serial():  # ranks that are threads (seqpar.threaded) share the global RNG: they take turns
        torch.manual_seed(cfg.seed)  # LoRA A init: identical on every rank and in the SP=1 reference
        return apply_lora(model, cfg)


def _wrap(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, world: int) -> MasterWeights | None:
    """Step 5 of seqpar.hf.prepare: FSDP2, or bf16 master weights without FSDP (returned), in train mode."""
    model.train()
    prec = None
    if cfg.precision == "bf16" and not cfg.fsdp:
        prec = MasterWeights(model)
        model.to(torch.bfloat16)
    if cfg.fsdp:
        # GRPO rollouts run the model's own image path, which only ranks whose prompts hold images would enter:
        # the tower stays in the root unit there (gathered by every rank's forward), per-block units otherwise.
        apply_fsdp(model, device, world, cfg.precision == "bf16", offload=cfg.fsdp.offload,
                   timeout=cfg.collective_timeout, vision="root" if cfg.stage == "grpo" else "blocks")
    return prec


def build_reference(cfg: TrainConfig, mesh: Any, ref_model: torch.nn.Module | None, policy: torch.nn.Module) -> Any:
    """The reference log-probs the stage needs: of the frozen copy (full fine-tuning), or of the policy with
    its LoRA adapter disabled. DPO: per-sequence sums; GRPO: per-token, at the sampling temperature."""
    kw: dict[str, Any] = prepare_spec(cfg).head_kwargs()
    if cfg.stage == "grpo":
        kw["temperature"] = cfg.grpo.temperature
        return (ReferenceTokenLogps(ref_model=ref_model, **kw) if ref_model is not None
                else ReferenceTokenLogps(policy=policy, **kw))
    return (ReferenceLogps(mesh, ref_model=ref_model, **kw) if ref_model is not None
            else ReferenceLogps(mesh, policy=policy, **kw))


def shard_reference(cfg: TrainConfig, ref_model: torch.nn.Module, device: torch.device, world: int) -> None:
    """The frozen reference of a full fine-tuning run under FSDP2, sharded over all ranks like the policy (per
    decoder layer, then the root): it costs params/world per rank instead of a whole copy on every rank. Its
    weights are already in the compute dtype (bf16 cast above), so no mixed-precision policy; host offload
    follows fsdp.offload. Every rank runs each reference forward (FSDP2 all-gathers a layer at a time): the
    step calls it once per micro-batch on every rank, as the policy's forward (train/loop/build.py refuses a
    dataset whose precomputed reference log-probs would let some ranks skip it)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    # The root too: by default FSDP2 keeps the root's parameters (embeddings, head) gathered after forward for
    # the backward that follows, which a no-grad reference forward never has: they would stay gathered.
    kw: dict[str, Any] = {"reshard_after_forward": True}
    if cfg.fsdp.offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    shard_over_world(ref_model, device.type, world, cfg.collective_timeout, **kw)


def check_memory_features(cfg: TrainConfig, model: torch.nn.Module, on_accelerator: bool) -> None:
    """Memory options that cannot work here fail before the process group (identically on every rank).
    Both offloads run on CPU-only machines too (docs/memory.md), so on_accelerator refuses nothing today."""
    check_model_memory(model, prepare_spec(cfg))


def apply_fsdp(model: torch.nn.Module, device: torch.device, world: int, bf16: bool, offload: bool = False,
               timeout: timedelta | None = None, vision: str = "blocks") -> None:
    """FSDP2 over the flattened dp x sp world; its mesh's group times out after `timeout` (None: the default
    group's timeout; seqpar.mesh.group_timeout_override says why that needs saying)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kw: dict[str, Any] = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:  # runs on CPU (host-to-host, exact; tests/test_memory_offload.py); pinned buffers on accelerators
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    shard_over_world(model, device.type, world, timeout, vision=vision, **kw)
