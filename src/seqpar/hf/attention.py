"""Plug seqpar attention into an unmodified Hugging Face causal LM (transformers 5.x).

How it works (see docs/hf.md):
- a seqpar attention function is registered with `transformers.AttentionInterface.register` under a
  name unique to this model (e.g. "seqpar_sp_3"), and only this model's own config copy points at it:
  other models in the process keep their attention;
- every other op of a decoder (embeddings, norms, MLP, RoPE with the explicit GLOBAL position_ids,
  lm_head) is per token, so it runs unchanged on the local shard;
- a forward pre-hook on the decoder backbone checks the inputs and derives, once per forward and
  identically on every SP rank, where packed documents start (from the FULL position_ids, gathered
  over the SP group: pitfall 7). The plan reaches the attention function through the layer kwargs,
  and through per-model state when a model does not forward unknown kwargs.
"""

from __future__ import annotations

import copy
import itertools
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import attention as sp_attention
from ..attention import validate_cu_seqlens
from ..data import document_starts
from ..errors import SeqParError
from ..layout import check_length, local_positions, unshard
from ..mesh import SequenceParallelMesh
from ..unwrap import BATCH_INPUTS_HOOK
from ..unwrap import base_model as _base_model
from .linear_attention import check_linear_attention, find_linear_attention, sp_gated_delta_forward
from .mixers import check_softmax_attention_only
from .vision import check_vlm, is_vlm, refuse_unsharded_vision, vision_batch_inputs, vlm_language_model

__all__ = ["apply_sequence_parallel", "remove_sequence_parallel", "is_sequence_parallel", "ForwardPlan"]

_PLAN_KWARG = "seqpar_plan"
_CU_KWARGS = ("cu_seqlens", "cu_seq_lens_q")
# kwargs that change attention semantics in ways seqpar does not implement
_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks (s_aux)", "sinks": "attention sinks"}
_counter = itertools.count()
_lock = threading.Lock()


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward needs to know about the FULL sequence; identical on all SP ranks."""

    full_len: int
    # Per row: inner document boundaries in the full sequence (empty tuple = one document).
    row_bounds: tuple[tuple[int, ...], ...]

    @property
    def packed(self) -> bool:
        return any(self.row_bounds)


class _SPState:
    """Per-model state: the mesh, the registered name and what remove_sequence_parallel restores."""

    def __init__(self, mesh: SequenceParallelMesh, name: str):
        self.mesh = mesh
        self.name = name
        self.plan: ForwardPlan | None = None  # fallback for models that drop unknown kwargs
        self.kwarg_seen = False  # whether the last forward's plan reached attention via kwargs
        self.handles: list[Any] = []
        self.restore: dict[str, Any] = {}
        self.finalizer: Any = None

    def __deepcopy__(self, memo: dict) -> _SPState:
        # A copy would share this model's registration (and mesh process groups): refuse clearly.
        raise SeqParError(
            "cannot deep-copy a model with sequence parallelism applied: copy it before "
            "apply_sequence_parallel (or after remove_sequence_parallel), then apply SP to each copy"
        )


def _backbone(base: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (LlamaModel, ...): the module that receives position_ids and kwargs."""
    inner = getattr(base, "base_model", None)
    if isinstance(inner, torch.nn.Module) and inner is not base:
        return inner
    return base


def is_sequence_parallel(model: torch.nn.Module) -> bool:
    return getattr(_base_model(model), "_seqpar_state", None) is not None


# ----------------------------------------------------------------------------- checks on the model
def _check_config(cfg: Any) -> None:
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
    sinks = getattr(cfg, "use_sinks", None)
    if sinks:
        raise SeqParError("attention sinks are not supported by seqpar")
    if getattr(cfg, "output_router_logits", False):
        # HF adds the load-balancing loss only with labels= (refused under SP), and per shard it would differ.
        raise SeqParError(
            "config.output_router_logits=True: the MoE router load-balancing (aux) loss is not supported under SP "
            "(it is a product of whole-sequence means, which a shard cannot compute; seqpar's losses never add "
            "it): set config.output_router_logits = False"
        )


def _module_is_causal(module: Any) -> bool:
    return bool(getattr(module, "is_causal", True))


# ----------------------------------------------------------------------------- the attention function
def _make_attention_fn(state_ref: weakref.ReferenceType) -> Any:
    def seqpar_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        state: _SPState | None = state_ref()
        if state is None:
            raise SeqParError("the model this seqpar attention belonged to is gone; call apply_sequence_parallel again")
        mesh = state.mesh
        plan: ForwardPlan | None = kwargs.get(_PLAN_KWARG)
        if plan is None:
            plan = state.plan
        else:
            state.kwarg_seen = True
        if plan is None:
            raise SeqParError(
                "seqpar attention was called without a forward plan: call the model itself "
                "(model(input_ids=..., position_ids=...)), not a layer on its own"
            )
        b, hq, s_loc, d = query.shape
        full_len = s_loc * mesh.sp_size
        # All checks depend only on module config and shapes: every SP rank raises alike, before communicating.
        if full_len != plan.full_len or b != len(plan.row_bounds):
            raise SeqParError(
                f"attention got B={b}, full length {full_len} but the forward plan says B={len(plan.row_bounds)}, "
                f"length {plan.full_len}: the model changed the sequence between embedding and attention"
            )
        if attention_mask is not None:
            raise SeqParError(
                "a materialised attention mask reached seqpar attention; seqpar builds its own causal / "
                "document masking: do not pass custom 4-D masks"
            )
        if not _module_is_causal(module):
            raise SeqParError(
                f"{type(module).__name__} is not causal (is_causal=False): seqpar supports causal LMs only"
            )
        if dropout and dropout > 0:
            raise SeqParError(
                f"attention dropout={dropout} (train mode) is not supported under SP: the dropout mask would "
                "differ from the unsharded model's; set config.attention_dropout = 0.0 (eval mode is fine)"
            )
        if softcap is not None:
            raise SeqParError(
                f"attention logit softcapping (softcap={softcap}) is not supported under SP: "
                "set config.attn_logit_softcapping = None"
            )
        if sliding_window is not None and full_len > int(sliding_window):
            raise SeqParError(
                f"{type(module).__name__} layer uses a sliding window of {sliding_window} tokens but the sequence "
                f"has {full_len}: seqpar implements full causal attention only; keep sequences <= "
                f"{sliding_window} tokens or raise config.sliding_window"
            )
        for k, what in _UNSUPPORTED_KWARGS.items():
            if kwargs.get(k) is not None:
                raise SeqParError(f"{what} are not supported under SP")
        if getattr(module, "sinks", None) is not None:
            raise SeqParError("attention sinks are not supported under SP")
        q = query.transpose(1, 2)
        k_ = key.transpose(1, 2)
        v = value.transpose(1, 2)
        if torch.is_autocast_enabled(q.device.type):
            # Under autocast (Trainer bf16=True / fp16=True; TRL's default) RoPE promotes q/k to fp32 while v
            # stays in the autocast dtype; SDPA casts all three to that dtype, and so do we.
            dt = torch.get_autocast_dtype(q.device.type)
            q, k_, v = q.to(dt), k_.to(dt), v.to(dt)
        if not plan.packed:
            out = sp_attention(q, k_, v, mesh, causal=True, softmax_scale=scaling)
        else:
            # Rows without documents go together; each packed row is one call with its own boundaries.
            plain = [i for i, bnd in enumerate(plan.row_bounds) if not bnd]
            pieces: dict[int, torch.Tensor] = {}
            if plain:
                idx = torch.tensor(plain, device=q.device)
                o = sp_attention(q[idx], k_[idx], v[idx], mesh, causal=True, softmax_scale=scaling)
                for j, i in enumerate(plain):
                    pieces[i] = o[j : j + 1]
            for i, bnd in enumerate(plan.row_bounds):
                if bnd:
                    cu = [0, *bnd, full_len]
                    pieces[i] = sp_attention(
                        q[i : i + 1], k_[i : i + 1], v[i : i + 1], mesh, causal=True, softmax_scale=scaling,
                        cu_seqlens=cu,
                    )
            out = torch.cat([pieces[i] for i in range(b)], dim=0)
        return out, None

    return seqpar_attention_forward


def _make_linear_forward(state_ref: weakref.ReferenceType) -> Any:
    """Replacement forward for a Gated DeltaNet layer (bound to the instance; same signature as upstream's)."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, cache_params: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        state: _SPState | None = state_ref()
        if state is None:
            raise SeqParError("the model this seqpar layer belonged to is gone; call apply_sequence_parallel again")
        plan: ForwardPlan | None = kwargs.get(_PLAN_KWARG) or state.plan
        if plan is None:
            raise SeqParError(
                "a sequence-parallel linear-attention layer was called without a forward plan: call the model "
                "itself (model(input_ids=..., position_ids=...)), not a layer on its own"
            )
        b, s_loc = int(hidden_states.shape[0]), int(hidden_states.shape[1])
        if s_loc * state.mesh.sp_size != plan.full_len or b != len(plan.row_bounds):
            raise SeqParError(
                f"{type(self).__name__} got B={b}, full length {s_loc * state.mesh.sp_size} but the forward plan "
                f"says B={len(plan.row_bounds)}, length {plan.full_len}"
            )
        # cache_params (transformers >= 5.24: `cache`, in kwargs): never filled under SP (use_cache is forced off;
        # filled caches are refused by the plan).
        return sp_gated_delta_forward(self, hidden_states, attention_mask, plan.row_bounds, state.mesh)

    return forward


# ----------------------------------------------------------------------------- per-forward plan
def _bounds_of(pos_row: torch.Tensor) -> tuple[int, ...]:
    """Inner document starts of one full row (the collator's rule: a position that is not previous + 1)."""
    starts = torch.nonzero(document_starts(pos_row)[1:]).reshape(-1) + 1
    return tuple(int(x) for x in starts.tolist())


def _explicit_cu(kwargs: dict) -> Any:
    """The first packed-document boundary kwarg given to model(...), unvalidated (or None)."""
    return next((kwargs[n] for n in _CU_KWARGS if kwargs.get(n) is not None), None)


def _looks_local(full_pos: torch.Tensor, mesh: SequenceParallelMesh) -> torch.Tensor:
    """Per row: does every SP rank hold exactly arange(S_local)? (Positions made per shard, not globally.)"""
    b, full_len = full_pos.shape
    s_loc = full_len // mesh.sp_size
    # Global indices of each rank's shard, in that rank's local order (zigzag seams included).
    order = torch.stack([local_positions(full_len, mesh, s) for s in range(mesh.sp_size)]).to(full_pos.device)
    per_rank = full_pos[:, order]  # [B, sp, S_local]
    return (per_rank == torch.arange(s_loc, device=full_pos.device)).all(dim=2).all(dim=1)


def _refuse_local_positions(full_pos: torch.Tensor, mesh: SequenceParallelMesh, derived: list) -> None:
    """Refuse per-shard position_ids (the classic SP bug): their restarts at the shard seams would be
    read as packed-document starts, silently breaking RoPE and attention. Packed documents that all
    start exactly on the seams look the same; an explicit cu_seqlens says which one is meant."""
    if mesh.sp_size == 1 or not bool(_looks_local(full_pos, mesh).all()):
        return
    raise SeqParError(
        f"position_ids look per-shard: every SP rank holds arange({full_pos.shape[1] // mesh.sp_size}), so "
        f"positions restart at every shard seam (full-sequence indices {list(derived[0])}). Under SP they must be "
        "the GLOBAL positions of the full sequence: pass position_ids=seqpar.shard(full_position_ids, mesh, 1) "
        "(seqpar.data.SequenceParallelCollator returns them; for one unpacked row use "
        "seqpar.local_positions(full_len, mesh)). If these really are packed documents that each start exactly "
        "at a shard seam, pass the full sequence's boundaries as cu_seqlens (B=1, e.g. "
        f"cu_seqlens={[0, *derived[0], full_pos.shape[1]]}) to say so"
    )


def _make_plan(state: _SPState, kwargs: dict) -> ForwardPlan:
    mesh = state.mesh
    ids = kwargs.get("input_ids")
    emb = kwargs.get("inputs_embeds")
    ref = ids if ids is not None else emb
    if ref is None:
        raise SeqParError("the model got neither input_ids nor inputs_embeds")
    b, s_loc = int(ref.shape[0]), int(ref.shape[1])
    full_len = s_loc * mesh.sp_size
    pos = kwargs.get("position_ids")
    if pos is None:
        raise SeqParError(
            "position_ids are required under sequence parallelism (otherwise RoPE restarts at 0 on every "
            "shard): pass position_ids=seqpar.shard(full_position_ids, mesh, 1) (the seqpar collator "
            "returns them; for one unpacked row use seqpar.local_positions(full_len, mesh))"
        )
    past = next((kwargs[n] for n in ("cache", "past_key_values") if kwargs.get(n) is not None), None)  # >= 5.24
    if past is not None and (not hasattr(past, "get_seq_length") or past.get_seq_length() > 0):
        raise SeqParError("a filled KV cache (cache / past_key_values) is not supported under SP: generate without "
                          "SP")
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() == 3 and pos.shape[0] == 4:  # vision-language models: text positions, then multimodal RoPE ids
        pos = pos[0]
    if pos.dim() != 2 or pos.shape[-1] != s_loc or pos.shape[0] not in (1, b):
        raise SeqParError(f"position_ids must be [B, S_local]=[{b}, {s_loc}], got {tuple(pos.shape)}")
    pos = pos.expand(b, s_loc).long()
    check_length(full_len, mesh)  # same on every rank: raises before the gather below
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2 or tuple(mask.shape) != (b, s_loc):
            raise SeqParError(
                f"attention_mask must be a 2-D padding mask [B, S_local]=[{b}, {s_loc}] under SP, got "
                f"{tuple(mask.shape)}; better: drop it (the seqpar collator pads on the right, which causal "
                "attention never looks at)"
            )
        stacked = torch.stack([pos, mask.long().to(pos.device)])
    else:
        stacked = pos[None]
    # One small integer gather per forward, so all SP ranks take the same decisions (no rank may raise alone).
    full = unshard(stacked.to(mesh.comm_device), mesh, dim=2) if mesh.sp_size > 1 else stacked
    full_pos = full[0]
    if mask is not None:
        m = full[1] != 0
        # Right padding only: after the first masked token nothing may be unmasked again.
        bad = (m[:, 1:] & ~m[:, :-1]).any(dim=1)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            raise SeqParError(
                f"attention_mask row {row} is not right-padded (left padding or holes): under SP attention "
                "uses no padding mask, so pad on the right (seqpar.data.SequenceParallelCollator does) "
                "and mark padding with label -100"
            )
    cu = _explicit_cu(kwargs)
    derived = [_bounds_of(full_pos[i]) for i in range(b)]
    if cu is not None:
        if b != 1:
            raise SeqParError(f"cu_seqlens (packed documents) needs batch size 1, got B={b}: pack rows into one")
        inner = tuple(validate_cu_seqlens(cu, full_len))
        missing = sorted(set(derived[0]) - set(inner))
        if missing:
            raise SeqParError(
                f"position_ids restart at full-sequence index {missing[0]} but cu_seqlens has no boundary there: "
                "cu_seqlens and position_ids disagree (compute both from the full sequence, e.g. with the "
                "seqpar collator)"
            )
        derived = [inner]
    else:
        _refuse_local_positions(full_pos, mesh, derived)
    return ForwardPlan(full_len=full_len, row_bounds=tuple(derived))


def _make_backbone_hook(state_ref: weakref.ReferenceType) -> Any:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        state: _SPState | None = state_ref()
        if state is None:
            return args, kwargs
        if args:
            # Transformers calls the backbone with keywords; positional input_ids is the first argument.
            kwargs = {**kwargs, "input_ids": args[0]}
            args = ()
        plan = _make_plan(state, kwargs)
        state.plan = plan
        state.kwarg_seen = False
        kwargs = dict(kwargs)
        kwargs[_PLAN_KWARG] = plan
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False  # a KV cache of local shards is useless under SP
        elif "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return args, kwargs

    return hook


def _refuse_labels_loss(*args: Any, **kwargs: Any) -> Any:
    raise SeqParError(
        "labels= was passed to a sequence-parallel model: HF would shift labels inside each shard and "
        "average per rank (pitfalls 1 and 4). Call the model without labels and compute the loss with "
        "seqpar.loss.sft_loss(logits, batch['shift_labels'], num_items) on the collator's output"
    )


# ----------------------------------------------------------------------------- public API
def apply_sequence_parallel(model: torch.nn.Module, mesh: SequenceParallelMesh) -> torch.nn.Module:
    """Make an unmodified HF causal LM run sequence-parallel over `mesh`; returns the same model.

    Afterwards `model(input_ids=shard(ids), position_ids=shard(pos), [cu_seqlens=full_cu])` returns
    this rank's shard of the logits (in the order of `seqpar.shard`). Works in train and eval mode
    and with PEFT wrappers (apply before or after get_peft_model). Only this model is affected: it
    gets its own config copy pointing at an attention function registered under a unique name.
    Raises SeqParError for what seqpar cannot run exactly: softcapped attention logits, attention
    sinks, nested/encoder-decoder configs, MoE router aux losses (output_router_logits), any sequence
    mixing outside softmax attention (linear attention, Mamba/SSM, convolutions, recurrences, chunked
    attention: see seqpar.hf.mixers) except the Gated DeltaNet layers of Qwen3-Next / Qwen3.5, which
    run under pure Ulysses (ring_degree=1, k heads divisible by the degree: seqpar.hf.linear_attention)
    (here); attention dropout in train mode, non-causal attention, sliding windows shorter than
    the sequence (per forward, on every rank alike).
    """
    from transformers import AttentionInterface

    if not isinstance(mesh, SequenceParallelMesh):
        raise SeqParError(f"mesh must be a seqpar.SequenceParallelMesh (seqpar.init_mesh), got {type(mesh).__name__}")
    base = _base_model(model)
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
    _check_config(cfg)
    linear = find_linear_attention(base)  # Gated DeltaNet (Qwen3-Next, Qwen3.5): run by seqpar under Ulysses
    check_linear_attention(linear, mesh)
    allowed = frozenset({"linear_attention"}) if linear else frozenset()
    decoder = vlm_language_model(base) if vlm else base  # a vision tower's patch convolution is no sequence mixer
    check_softmax_attention_only(decoder, cfg, tuple(linear), allowed)  # other linear attention, SSMs, convs, ...
    heads, kv = int(cfg.num_attention_heads), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    if heads % kv != 0:
        raise SeqParError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    with _lock:
        name = f"seqpar_sp_{next(_counter)}"
    state = _SPState(mesh, name)
    state_ref = weakref.ref(state)
    AttentionInterface.register(name, _make_attention_fn(state_ref))

    # Own config copy: models built from one config object share it, and the attention name lives there.
    old_cfg = cfg
    new_cfg = copy.deepcopy(cfg)
    owners = [m for m in base.modules() if getattr(m, "config", None) is old_cfg]
    for m in owners:
        m.config = new_cfg
    new_cfg._attn_implementation = name
    state.restore = {"config": old_cfg, "owners": [weakref.ref(m) for m in owners]}
    if "_loss_function" in base.__dict__:
        state.restore["loss_function"] = base.__dict__["_loss_function"]
    base.loss_function = _refuse_labels_loss

    for layer in linear:  # an instance attribute shadows the class's forward; removed again on remove
        layer.forward = types.MethodType(_make_linear_forward(state_ref), layer)
    state.restore["linear"] = [weakref.ref(m) for m in linear]

    backbone = vlm_language_model(base) if vlm else _backbone(base)
    state.handles.append(backbone.register_forward_pre_hook(_make_backbone_hook(state_ref), with_kwargs=True))
    if vlm:  # images and multimodal positions must come from sp_vlm_inputs (the full sequence)
        state.handles.append(base.model.register_forward_pre_hook(
            lambda module, args, kwargs: refuse_unsharded_vision(kwargs), with_kwargs=True))
        setattr(base, BATCH_INPUTS_HOOK, vision_batch_inputs)  # how seqpar.steps feeds a full vision batch
    base._seqpar_state = state
    # Unregister the name when the model is garbage-collected (state lives as long as the model).
    state.finalizer = weakref.finalize(base, _unregister, name)
    return model


def _unregister(name: str) -> None:
    from transformers import AttentionInterface

    AttentionInterface._global_mapping.pop(name, None)


def remove_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Undo apply_sequence_parallel: the model gets its original config (and attention) back."""
    base = _base_model(model)
    state: _SPState | None = getattr(base, "_seqpar_state", None)
    if state is None:
        raise SeqParError("sequence parallelism is not applied to this model")
    for h in state.handles:
        h.remove()
    for ref in state.restore["owners"]:
        m = ref()
        if m is not None:
            m.config = state.restore["config"]
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
