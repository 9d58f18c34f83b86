"""The functions a sequence-parallel model's layers call: seqpar's softmax attention (registered with
transformers' AttentionInterface under a name of the model's own) and the Gated DeltaNet forward. Each
first refuses what seqpar cannot run exactly, in one checked helper per function (`check_attention_call`):
every check reads only the module config and shapes, so every SP rank raises alike, before communicating.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch

from ..attention import attention as sp_attention
from ..attention.kernel_choice import describe_choice
from ..errors import SeqParError
from ..layout import local_positions
from ..mesh import SequenceParallelMesh
from .forward_plan import PLAN_KWARG, ForwardPlan, SPState
from .recurrent_layers import recurrent_forward, wants_positions

__all__ = ["make_attention_fn", "make_linear_forward", "check_attention_call"]

# The kwargs transformers' attention functions receive a layer's sink logits in (gpt-oss: s_aux).
_SINK_KWARGS = ("s_aux", "sinks")
NOPE_TEMPERATURE = "_seqpar_nope_temperature"  # (floor_scale, attn_scale) of a Llama 4 NoPE layer (hf.attention)


def _live_state(state_ref: weakref.ReferenceType, what: str) -> SPState:
    state: SPState | None = state_ref()
    if state is None:
        raise SeqParError(f"the model this seqpar {what} belonged to is gone; call apply_sequence_parallel again")
    return state


def check_attention_call(module: torch.nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
                         plan: ForwardPlan, mesh: SequenceParallelMesh, dropout: float, sliding_window: int | None,
                         softcap: float | None, kwargs: dict[str, Any]) -> None:
    """Every per-call refusal of seqpar attention (SeqParError naming the fix); returns when the call can run."""
    b, _, s_loc, _ = query.shape
    full_len = s_loc * mesh.sp_size
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
    if not bool(getattr(module, "is_causal", True)):
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
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
        raise SeqParError(f"{type(module).__name__}: sliding_window={sliding_window!r} must be a positive int")
    sinks = layer_sinks(module, kwargs)
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise SeqParError(
            f"{type(module).__name__}: attention sinks of shape {tuple(sinks.shape)}; seqpar reads one logit per q "
            f"head, shape [{query.shape[1]}]"
        )


def layer_sinks(module: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A layer's attention-sink logits: what transformers passes (s_aux), else the module's `sinks` parameter."""
    for name in _SINK_KWARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    sinks = getattr(module, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


_UNSET: Any = object()  # transformers did not pass sliding_window= at all (not even None)


def layer_window(module: torch.nn.Module, sliding_window: Any = _UNSET) -> int | None:
    """A layer's sliding window as the unsharded model's mask applies it. Most layers pass it to the attention
    function (sliding_window=, None for their full layers); some only keep it on the module (Qwen2-MoE) or
    leave it to the model's mask, from config.layer_types ('sliding_attention') or, without layer_types, for
    every layer from config.sliding_window (PhiMoE, Doge: their masks slide whenever it is set)."""
    if sliding_window is not _UNSET:
        return sliding_window
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    cfg = getattr(module, "config", None)
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)) and idx is not None:
        return cfg.sliding_window if types[idx] == "sliding_attention" else None
    return getattr(cfg, "sliding_window", None)


def _window(sliding_window: int | None, full_len: int) -> int | None:
    """The window seqpar runs: none where it covers the whole sequence (the same result, no banded pieces)."""
    return None if sliding_window is None or int(sliding_window) >= full_len else int(sliding_window)


def _chunk_size(module: torch.nn.Module) -> int | None:
    """Llama 4's chunked attention: the chunk of a layer whose config.layer_types says 'chunked_attention'."""
    cfg = getattr(module, "config", None)
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if not isinstance(types, (list, tuple)) or idx is None or types[idx] != "chunked_attention":
        return None
    return int(cfg.attention_chunk_size)


def _nope_temperature(module: torch.nn.Module, q: torch.Tensor, mesh: SequenceParallelMesh,
                      plan: ForwardPlan) -> torch.Tensor:
    """Llama 4's NoPE-layer query temperature from each token's GLOBAL position: its index in its document (the
    row index for an unpacked row, as transformers computes it unsharded; a packed document as if run alone).
    transformers takes it from arange(local length), so every shard would restart at 0. Its own ops otherwise."""
    floor_scale, attn_scale = getattr(module, NOPE_TEMPERATURE)
    idx = local_positions(plan.full_len, mesh).to(q.device)
    rows = []
    for bnd in plan.row_bounds:
        starts = torch.tensor([0, *bnd], device=q.device)
        rows.append(idx - starts[torch.searchsorted(starts[1:], idx, right=True)])
    pos = torch.stack(rows).float()
    scales = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * scales[:, :, None, None]).to(q.dtype)


def make_attention_fn(state_ref: weakref.ReferenceType) -> Any:
    """The attention function of one model (transformers' AttentionInterface signature)."""

    def seqpar_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = _UNSET,
        softcap: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        state = _live_state(state_ref, "attention")
        plan: ForwardPlan | None = kwargs.get(PLAN_KWARG)
        if plan is None:
            plan = state.plan
        else:
            state.kwarg_seen = True
        if plan is None:
            raise SeqParError(
                "seqpar attention was called without a forward plan: call the model itself "
                "(model(input_ids=..., position_ids=...)), not a layer on its own"
            )
        sliding_window = layer_window(module, sliding_window)
        check_attention_call(module, query, attention_mask, plan, state.mesh, dropout, sliding_window, softcap,
                             kwargs)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if torch.is_autocast_enabled(q.device.type):
            # Under autocast (Trainer bf16=True / fp16=True; TRL's default) RoPE promotes q/k to fp32 while v
            # stays in the autocast dtype; SDPA casts all three to that dtype, and so do we.
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if hasattr(module, NOPE_TEMPERATURE):
            q = _nope_temperature(module, q, state.mesh, plan)
        _announce_kernel(q, state.kernel)
        variant = {"window": _window(sliding_window, plan.full_len), "sinks": layer_sinks(module, kwargs)}
        chunk = _chunk_size(module)
        return _planned_attention(q, k, v, plan, state.mesh, scaling, state.kernel, state.head_chunks, chunk,
                                  variant), None

    return seqpar_attention_forward


_ANNOUNCED: set[str] = set()


def _announce_kernel(q: torch.Tensor, kernel: str) -> None:
    """Print which kernel attention runs on, once per process and choice, on global rank 0 (it also refuses a
    forced kernel that cannot take these inputs: SeqParError on every rank alike, before communicating)."""
    line = describe_choice(q.device, kernel, q.dtype, q.shape[-1], torch.is_grad_enabled() and q.requires_grad)
    if line in _ANNOUNCED:
        return
    _ANNOUNCED.add(line)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"[seqpar] {line}", flush=True)


def _planned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ForwardPlan,
                       mesh: SequenceParallelMesh, scaling: float | None, kernel: str = "auto",
                       head_chunks: int = 1, chunk: int | None = None,
                       variant: dict[str, Any] | None = None) -> torch.Tensor:
    """seqpar attention over the plan's rows: one call per distinct set of boundaries (the rows without documents
    together), a layer's attention chunks (Llama 4) added to every row's document boundaries."""
    attention = partial(sp_attention, kernel=kernel, head_chunks=head_chunks, causal=True, softmax_scale=scaling,
                        **(variant or {}))
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, bnd in enumerate(plan.row_bounds):
        rows.setdefault(_with_chunks(bnd, plan.full_len, chunk), []).append(i)
    if len(rows) == 1:
        ((bnd, _),) = rows.items()
        return attention(q, k, v, mesh, cu_seqlens=[0, *bnd, plan.full_len] if bnd else None)
    pieces: dict[int, torch.Tensor] = {}
    for bnd, idx in rows.items():
        sel = torch.tensor(idx, device=q.device)
        o = attention(q[sel], k[sel], v[sel], mesh, cu_seqlens=[0, *bnd, plan.full_len] if bnd else None)
        for j, i in enumerate(idx):
            pieces[i] = o[j : j + 1]
    return torch.cat([pieces[i] for i in range(q.shape[0])], dim=0)


def _with_chunks(bounds: tuple[int, ...], full_len: int, chunk: int | None) -> tuple[int, ...]:
    """A row's document boundaries plus its attention chunks', counted from each document's start (a packed
    document is chunked as if run alone; an unpacked row as transformers chunks it)."""
    if chunk is None:
        return tuple(bounds)
    starts = [0, *bounds]
    ends = [*bounds, full_len]
    return tuple(sorted({*bounds, *(c for a, b in zip(starts, ends) for c in range(a + chunk, b, chunk))}))


def make_linear_forward(state_ref: weakref.ReferenceType) -> Any:
    """Replacement forward for a recurrent mixer (Gated DeltaNet, Mamba2) bound to the instance; same signature as
    upstream's."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, cache_params: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        state = _live_state(state_ref, "layer")
        plan: ForwardPlan | None = kwargs.get(PLAN_KWARG) or state.plan
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
        extra = {"position_ids": kwargs.get("position_ids")} if wants_positions(self) else {}
        return recurrent_forward(self)(self, hidden_states, attention_mask, plan.row_bounds, state.mesh, **extra)

    return forward
