"""Plug seqpar attention into an unmodified Hugging Face causal LM (transformers 5.x): apply and remove.

How it works (see docs/hf.md):
- a seqpar attention function (hf/attention_fn.py) is registered with `transformers.AttentionInterface.register`
  under a name unique to this model (e.g. "seqpar_sp_3"), and only this model's own config copy points at it:
  other models in the process keep their attention;
- every other op of a decoder (embeddings, norms, MLP, RoPE with the explicit GLOBAL position_ids,
  lm_head) is per token, so it runs unchanged on the local shard;
- a forward pre-hook on the decoder backbone (hf/forward_plan.py) checks the inputs and derives, once per
  forward and identically on every SP rank, where packed documents start (from the FULL position_ids,
  gathered over the SP group: pitfall 7). The plan reaches the attention function through the layer kwargs,
  and through per-model state when a model does not forward unknown kwargs.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import re
import sys
import threading
import types
import weakref
from typing import Any

import torch

from ..attention.kernel_choice import check_kernel_name
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from ..unwrap import BATCH_INPUTS_HOOK
from ..unwrap import base_model as _base_model
from .attention_fn import NOPE_TEMPERATURE, make_attention_fn, make_linear_forward
from .forward_plan import ForwardPlan, SPState, make_backbone_hook
from .mixers import check_softmax_attention_only
from .recurrent_layers import check_recurrent, find_recurrent
from .vision import check_vlm, is_vlm, vision_batch_inputs, vision_pre_hook, vlm_language_model

__all__ = ["apply_sequence_parallel", "remove_sequence_parallel", "is_sequence_parallel", "ForwardPlan",
           "check_config", "use_mesh", "check_mesh"]

_counter = itertools.count()
_lock = threading.Lock()


def _backbone(base: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (LlamaModel, ...): the module that receives position_ids and kwargs. Where the base model
    only wraps the stack (OPT: OPTModel.decoder holds the layers, and OPTForCausalLM calls it directly), the stack."""
    inner = getattr(base, "base_model", None)
    inner = inner if isinstance(inner, torch.nn.Module) and inner is not base else base
    if inner is not base and "position_ids" not in inspect.signature(inner.forward).parameters:  # Mamba, Falcon-Mamba:
        return base  # the causal LM keeps position_ids (and cu_seqlens) to itself: the plan is made from its inputs
    decoder = getattr(inner, "decoder", None)  # (other stacks without `layers`, e.g. HRM's, take their own inputs)
    if not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList) and isinstance(
            getattr(decoder, "layers", None), torch.nn.ModuleList):
        return decoder
    return inner


def is_sequence_parallel(model: torch.nn.Module) -> bool:
    return getattr(_base_model(model), "_seqpar_state", None) is not None


# ----------------------------------------------------------------------------- checks on the model
def check_config(cfg: Any) -> None:
    """What seqpar's exact attention cannot run, from a (text) config alone: also read before launch by
    `seqpar train`'s model checks (train/model/checks.py)."""
    if getattr(cfg, "is_encoder_decoder", False):
        raise SeqParError("encoder-decoder models are not supported by seqpar: use a causal LM")
    soft = getattr(cfg, "attn_logit_softcapping", None)
    if soft is not None:
        raise SeqParError(
            f"{type(cfg).__name__}.attn_logit_softcapping={soft}: softcapped attention logits are not "
            "supported by seqpar's exact attention (the softmax merge needs plain logits); "
            "set config.attn_logit_softcapping = None (changes the model) or do not use SP"
        )
    # attention_dropout > 0 is refused per forward, in train mode only (HF passes dropout=0 in eval).
    if getattr(cfg, "output_router_logits", False):
        # HF adds the load-balancing loss only with labels= (refused under SP), and per shard it would differ.
        raise SeqParError(
            "config.output_router_logits=True: the MoE router load-balancing (aux) loss is not supported under SP "
            "(it is a product of whole-sequence means, which a shard cannot compute; seqpar's losses never add "
            "it): set config.output_router_logits = False"
        )


# Families whose attention builds a mask of its own from the hidden states: no AttentionInterface mask seqpar could
# replace (model_type -> what it does).
_OWN_MASK_FAMILIES = {"doge": "Doge's dynamic mask attention (a learned mask per key, built inside the layer)"}


_ATTENTION_NAME = re.compile(r"Attention|Attn")


def check_attention_interface(base: torch.nn.Module, cfg: Any) -> None:
    """SeqParError unless the model's attention goes through transformers' AttentionInterface (the one place seqpar
    replaces): a model that computes attention itself would attend within each rank's shard, silently wrong."""
    module = sys.modules.get(type(base).__module__)
    attends = any(_ATTENTION_NAME.search(type(m).__name__) for m in base.modules())  # (Mamba: no attention at all)
    if module is not None and not hasattr(module, "ALL_ATTENTION_FUNCTIONS") and attends:
        raise SeqParError(
            f"{type(base).__name__} computes attention itself, not through transformers' AttentionInterface, so "
            "seqpar cannot make it sequence-parallel (it would attend within each rank's shard): use a model whose "
            "attention does, or train without SP"
        )
    what = _OWN_MASK_FAMILIES.get(getattr(cfg, "model_type", None))
    if what is not None:
        raise SeqParError(f"{what} is not supported by seqpar's exact attention: train this model without SP")


def _refuse_labels_loss(*args: Any, **kwargs: Any) -> Any:
    raise SeqParError(
        "labels= was passed to a sequence-parallel model: HF would shift labels inside each shard and "
        "average per rank (pitfalls 1 and 4). Call the model without labels and compute the loss with "
        "seqpar.loss.sft_loss(logits, batch['shift_labels'], num_items) on the collator's output"
    )


def _checked_config(base: torch.nn.Module, mesh: SequenceParallelMesh) -> tuple[Any, bool, list]:
    """(the text config SP runs, whether it is a vision-language model, its Gated DeltaNet layers), after
    every check of the model: nothing is changed before all of them passed."""
    if not isinstance(mesh, SequenceParallelMesh):
        raise SeqParError(f"mesh must be a seqpar.SequenceParallelMesh (seqpar.init_mesh), got {type(mesh).__name__}")
    if getattr(base, "_seqpar_state", None) is not None:
        raise SeqParError("sequence parallelism is already applied to this model: call remove_sequence_parallel first")
    cfg = getattr(base, "config", None)
    if cfg is None:
        raise SeqParError(f"{type(base).__name__} has no config: apply_sequence_parallel needs a transformers model")
    vlm = is_vlm(cfg)
    if vlm:
        cfg = check_vlm(cfg)  # Qwen VL: SP runs the text decoder; the vision tower stays local (seqpar.hf.vision)
    elif getattr(cfg, "text_config", None) is not None and cfg.text_config is not cfg:
        raise SeqParError(
            "multimodal / nested-config models are not supported: apply SP to the text causal LM (e.g. "
            "model.language_model with its own lm_head)"
        )
    check_config(cfg)
    linear, allowed = find_recurrent(base)  # Gated DeltaNet, Mamba2, short convs: run by seqpar (recurrent_layers)
    check_recurrent(linear, mesh)
    decoder = vlm_language_model(base) if vlm else base  # a vision tower's patch convolution is no sequence mixer
    check_softmax_attention_only(decoder, cfg, tuple(linear), allowed)  # other linear attention, SSMs, convs, ...
    check_attention_interface(decoder, cfg)  # (after: an attention-free family's mixers are the better reason)
    heads = int(getattr(cfg, "num_attention_heads", None) or 1)  # 1: attention-free (Mamba, Falcon-Mamba)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % kv != 0:
        raise SeqParError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return cfg, vlm, linear


def _own_config(base: torch.nn.Module, cfg: Any, state: SPState) -> None:
    """Give the model its own config copy naming the registered attention; remember the shared one."""
    # Models built from one config object share it, and the attention name lives there.
    new_cfg = copy.deepcopy(cfg)
    owners = [m for m in base.modules() if getattr(m, "config", None) is cfg]
    for m in owners:
        m.config = new_cfg
    new_cfg._attn_implementation = state.name
    state.restore = {"config": cfg, "owners": [weakref.ref(m) for m in owners]}


# ----------------------------------------------------------------------------- public API
def apply_sequence_parallel(model: torch.nn.Module, mesh: SequenceParallelMesh, attention_kernel: str = "auto",
                            head_chunks: int = 1) -> torch.nn.Module:
    """Make an unmodified HF causal LM run sequence-parallel over `mesh`; returns the same model.

    Afterwards `model(input_ids=shard(ids), position_ids=shard(pos), [cu_seqlens=full_cu])` returns
    this rank's shard of the logits (in the order of `seqpar.shard`). Works in train and eval mode
    and with PEFT wrappers (apply before or after get_peft_model). Only this model is affected: it
    gets its own config copy pointing at an attention function registered under a unique name.
    Sliding windows, attention sinks, MLA's v head dim and Llama 4's NoPE temperature and chunked attention run
    exactly (docs/attention.md, "Attention variants").
    Raises SeqParError for what seqpar cannot run exactly: softcapped attention logits, nested/encoder-decoder
    configs, MoE router aux losses (output_router_logits), any sequence mixing outside softmax attention (linear
    attention, Mamba/SSM, convolutions, recurrences: see seqpar.hf.mixers) except the recurrent / conv mixers of
    seqpar.hf.recurrent_layers (Gated DeltaNet, KDA, Mamba2, Mamba1, LFM2's short convs, lightning attention,
    RecurrentGemma's RG-LRU), which run in every mode (ring / USP by state passing; the Ulysses degree must split
    their heads) (here); attention dropout in train mode, non-causal attention (per forward, on every rank alike).
    attention_kernel: seqpar.attention's kernel= (docs/gpu.md);
    the kernel each model's first attention call resolves to is printed once per process, on rank 0.
    head_chunks: seqpar.attention's head_chunks= (the kernels run per group of heads; attention.heads).
    The recurrent layers' states travel the ring as the mesh's `state_passing` says (seqpar.init_mesh).
    """
    from transformers import AttentionInterface

    base = _base_model(model)
    cfg, vlm, linear = _checked_config(base, mesh)
    with _lock:
        name = f"seqpar_sp_{next(_counter)}"
    if not isinstance(head_chunks, int) or head_chunks < 1:
        raise SeqParError(f"head_chunks must be an int >= 1, got {head_chunks!r}")
    state = SPState(mesh, name, check_kernel_name(attention_kernel), head_chunks)
    state_ref = weakref.ref(state)
    AttentionInterface.register(name, make_attention_fn(state_ref))
    _own_config(base, cfg, state)
    if "_loss_function" in base.__dict__:
        state.restore["loss_function"] = base.__dict__["_loss_function"]
    base.loss_function = _refuse_labels_loss

    for layer in linear:  # an instance attribute shadows the class's forward; removed again on remove
        layer.forward = types.MethodType(make_linear_forward(state_ref), layer)
    state.restore["linear"] = [weakref.ref(m) for m in linear]
    state.restore["nope"] = _take_nope_temperature(base)

    backbone = vlm_language_model(base) if vlm else _backbone(base)
    state.handles.append(backbone.register_forward_pre_hook(make_backbone_hook(state_ref), with_kwargs=True))
    if vlm:  # images and multimodal positions must come from sp_vlm_inputs (the full sequence)
        state.handles.append(base.model.register_forward_pre_hook(vision_pre_hook, with_kwargs=True))
        setattr(base, BATCH_INPUTS_HOOK, vision_batch_inputs)  # how seqpar.steps feeds a full vision batch
    base._seqpar_state = state
    # Unregister the name when the model is garbage-collected (state lives as long as the model).
    state.finalizer = weakref.finalize(base, _unregister, name)
    return model


def _take_nope_temperature(base: torch.nn.Module) -> list:
    """Llama 4's NoPE layers scale queries by a temperature of the token's index, which transformers takes from
    arange(local length): under SP every shard would restart at 0. The layer's own scaling is switched off (an
    instance attribute) and seqpar's attention applies it from the global indices (attention_fn)."""
    taken = []
    for m in base.modules():
        if getattr(m, "attn_temperature_tuning", False) and hasattr(m, "use_rope") and not m.use_rope:
            setattr(m, NOPE_TEMPERATURE, (float(m.floor_scale), float(m.attn_scale)))
            taken.append((weakref.ref(m), m.attn_temperature_tuning))
            m.attn_temperature_tuning = False
    return taken


def _give_back_nope_temperature(taken: list) -> None:
    for ref, value in taken:
        m = ref()
        if m is not None:
            m.attn_temperature_tuning = value
            m.__dict__.pop(NOPE_TEMPERATURE, None)


def check_mesh(model: torch.nn.Module, mesh: SequenceParallelMesh) -> None:
    """SeqParError unless an SP model's layers can run on `mesh` (a hybrid's recurrent layers bound the Ulysses
    degree); the same on every rank (config and mesh only)."""
    base = _base_model(model)
    check_recurrent(find_recurrent(base)[0], mesh)


def use_mesh(model: torch.nn.Module, mesh: SequenceParallelMesh) -> None:
    """Run the SP model's next forwards, and the backwards of their graphs, on `mesh` (length-aware SP: the group
    view of each micro-batch's degree, seqpar.dynamic). Check the mesh with `check_mesh` once beforehand. The
    attention, a hybrid's recurrent layers and a VLM's vision inputs read the mesh at each call; a forward's
    backward must run before the next switch (activation checkpointing recomputes in backward)."""
    state = getattr(_base_model(model), "_seqpar_state", None)
    if state is None:
        raise SeqParError("use_mesh: sequence parallelism is not applied to this model (apply_sequence_parallel)")
    if not isinstance(mesh, SequenceParallelMesh):
        raise SeqParError(f"use_mesh needs a SequenceParallelMesh, got {type(mesh).__name__}")
    state.mesh = mesh


def _unregister(name: str) -> None:
    from transformers import AttentionInterface

    AttentionInterface._global_mapping.pop(name, None)


def remove_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Undo apply_sequence_parallel: the model gets its original config (and attention) back."""
    base = _base_model(model)
    state: SPState | None = getattr(base, "_seqpar_state", None)
    if state is None:
        raise SeqParError("sequence parallelism is not applied to this model")
    for h in state.handles:
        h.remove()
    for ref in state.restore["owners"]:
        m = ref()
        if m is not None:
            m.config = state.restore["config"]
    _give_back_nope_temperature(state.restore.get("nope", []))
    for ref in state.restore.get("linear", []):
        m = ref()
        if m is not None:
            m.__dict__.pop("forward", None)
    if "loss_function" in state.restore:
        base.loss_function = state.restore["loss_function"]
    else:
        base.__dict__.pop("_loss_function", None)
    base.__dict__.pop(BATCH_INPUTS_HOOK, None)
    state.finalizer()
    del base._seqpar_state
    return model
