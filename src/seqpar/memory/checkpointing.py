"""Per-decoder-layer activation checkpointing (non-reentrant), optionally with the kept layer inputs in host memory.

    enable_activation_checkpointing(model)                 # after apply_sequence_parallel / get_peft_model,
    enable_activation_checkpointing(model, offload=True)   # before FSDP2's fully_shard (memory.offload_activations)

Why transformers' own switch (`PreTrainedModel.activation_checkpointing_enable`, the deprecated
`gradient_checkpointing_enable` on older 5.x) rather than torch's checkpoint_wrapper: every decoder layer of
the supported archs is a `GradientCheckpointingLayer`, which checkpoints the layer's *forward*, not its
`__call__`, so module hooks (FSDP2's unshard / reshard) stay outside the recompute; nothing is replaced
(state_dict keys, PEFT and FSDP2 see the same module tree); and the HF Trainer's `gradient_checkpointing=True`
goes through the very same code, so both trainers checkpoint alike.

Exact under SP, where the recompute re-runs the SP attention collectives inside backward:
- the layer kwargs are bound into the checkpointed call (`functools.partial(forward, self, **kwargs)`), so
  the recompute uses the seqpar forward plan of ITS forward, even after later forwards (the next
  micro-batch, a DPO reference pass) replaced the model's current plan;
- non-reentrant: a layer is recomputed when backward first needs one of its saved tensors. The graph is the
  same on every rank (same model, same requires_grad flags), so every rank recomputes the same layers in
  the same order; under no_grad (eval, DPO reference forwards) nothing is saved and nothing is recomputed
  on any rank, and HF does not checkpoint at all in eval mode;
- early_stop=False: by default torch stops a recompute as soon as the last tensor backward needs exists;
  where that is depends on which tensors the layer saved, which may differ between ranks (ring steps that
  skip blocks), so one rank could stop while the others still wait in a collective. We recompute whole layers.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..attention.kernels import attention_forward_ops
from ..errors import SeqParError
from ..unwrap import base_model as _base_model
from .offload import install_activation_offload

__all__ = ["CHECKPOINT_KWARGS", "checkpoint_kwargs", "enable_activation_checkpointing", "drop_input_require_grads",
           "is_activation_checkpointing", "keep_attention_context"]

# What every checkpointed layer call gets (torch.utils.checkpoint.checkpoint keyword arguments).
CHECKPOINT_KWARGS: dict[str, Any] = {"use_reentrant": False, "early_stop": False}


def keep_attention_context() -> Any:
    """torch's selective-checkpoint contexts for keep_attention: the attention kernels' forward outputs (every
    kernel call's out and lse, for each layer) are saved by the forward and handed to the layer's recompute,
    which then runs everything again but them. Exact (the recompute gets the very tensors); the SP collectives
    around the kernels still run in the recompute, on every rank alike."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = attention_forward_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(user: dict[str, Any] | None = None, *, zero3: bool = False,
                      keep_attention: bool = False) -> dict[str, Any]:
    """`user` checkpoint kwargs (e.g. TrainingArguments.gradient_checkpointing_kwargs) made SP-safe.

    Keys the Trainer handles itself (every_n_layers, offload) pass through; use_reentrant=True and
    early_stop=True are refused rather than silently overridden.

    zero3: the model runs under DeepSpeed ZeRO-3, which releases a module's gathered parameters in its
    post-forward hook. A whole-layer recompute runs the layer's last modules to their end, so those hooks
    release weights the recomputed graph still holds (backward then finds them empty). With early_stop the
    recompute ends inside the last op that saves a tensor, before that hook, as in the stock Trainer with
    ZeRO-3. It stays SP-safe for decoder layers: every rank's last saved tensor is in the MLP (or MoE)
    after the attention, i.e. after all of the layer's collectives, so no rank stops before one of them.
    """
    out = dict(user or {})
    if out.get("use_reentrant", False):
        raise SeqParError(
            "use_reentrant=True activation checkpointing is not supported under sequence parallelism (seqpar "
            "recomputes layers non-reentrantly so every rank re-runs the same collectives): drop use_reentrant "
            "from gradient_checkpointing_kwargs or set it to False"
        )
    if out.get("early_stop", False):
        raise SeqParError(
            "early_stop=True activation checkpointing could end a layer's recompute at a different point on each "
            "SP rank (inside a collective): drop early_stop from gradient_checkpointing_kwargs"
        )
    out.update(CHECKPOINT_KWARGS)
    if zero3:
        out["early_stop"] = True
    if keep_attention:
        out["context_fn"] = keep_attention_context
    return out


def enable_activation_checkpointing(model: torch.nn.Module, *, offload: bool = False, every_n_layers: int = 1,
                                    keep_attention: bool = False) -> None:
    """Checkpoint every `every_n_layers`-th decoder layer of `model` (a PEFT wrapper is fine); returns nothing.

    offload: keep the checkpointed layers' inputs in host memory (seqpar.memory.offload; exercised on CPU,
    side-stream copies and prefetch on accelerators) instead of transformers' save_on_cpu, whose copies
    block the compute stream and which does nothing measurable on a CPU-only run. keep_attention: the recompute
    reuses the attention kernels' forward outputs instead of running them again (`keep_attention_context`).
    Apply before FSDP2's fully_shard.
    """
    base = _base_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise SeqParError(
            f"{type(base).__name__} does not support activation checkpointing: set "
            "memory.activation_checkpointing: false"
        )
    enable = getattr(base, "activation_checkpointing_enable", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias on some 5.x versions
        if enable is not None:
            enable(activation_checkpointing_kwargs=checkpoint_kwargs(keep_attention=keep_attention),
                   every_n_layers=every_n_layers)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(
                keep_attention=keep_attention), every_n_layers=every_n_layers)
    if not is_activation_checkpointing(model):
        raise SeqParError(
            f"{type(base).__name__} has no checkpointable decoder layers: set memory.activation_checkpointing: false"
        )
    drop_input_require_grads(model)
    if offload:
        install_activation_offload(base)


def drop_input_require_grads(model: torch.nn.Module) -> None:
    """Remove transformers' "make the embedding output require grad" forward hooks.

    transformers adds them with checkpointing (and PEFT recipes call enable_input_require_grads()): reentrant
    checkpointing needs a grad-requiring input. seqpar checkpoints non-reentrantly, and with a frozen
    embedding (LoRA) the hook makes backward compute and keep the embedding output's unused gradient,
    [rows, S_local, hidden], until the step ends. A second enable_input_require_grads() call loses the first
    call's handles, so the hooks are found on the embedding modules themselves, not through the handles.
    """
    for module in _base_model(model).modules():
        get = getattr(module, "get_input_embeddings", None)
        try:
            emb = get() if callable(get) else None
        except NotImplementedError:
            continue
        hooks = getattr(emb, "_forward_hooks", None)
        for key, fn in list((hooks or {}).items()):
            if getattr(fn, "__name__", "") == "make_inputs_require_grads":
                del hooks[key]


def is_activation_checkpointing(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in _base_model(model).modules())
