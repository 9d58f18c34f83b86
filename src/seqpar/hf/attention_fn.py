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
from ..mesh import SequenceParallelMesh
from .forward_plan import PLAN_KWARG, ForwardPlan, SPState
from .linear_attention import sp_gated_delta_forward
from .mamba2 import MAMBA2_CLASSES, sp_mamba2_forward

__all__ = ["make_attention_fn", "make_linear_forward", "check_attention_call"]

# kwargs that change attention semantics in ways seqpar does not implement
_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks (s_aux)", "sinks": "attention sinks"}


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
        sliding_window: int | None = None,
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
        check_attention_call(module, query, attention_mask, plan, state.mesh, dropout, sliding_window, softcap,
                             kwargs)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if torch.is_autocast_enabled(q.device.type):
            # Under autocast (Trainer bf16=True / fp16=True; TRL's default) RoPE promotes q/k to fp32 while v
            # stays in the autocast dtype; SDPA casts all three to that dtype, and so do we.
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        _announce_kernel(q, state.kernel)
        return _planned_attention(q, k, v, plan, state.mesh, scaling, state.kernel, state.head_chunks), None

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
                       head_chunks: int = 1) -> torch.Tensor:
    """seqpar attention over the plan's rows: one call for the rows without documents, one per packed row."""
    attention = partial(sp_attention, kernel=kernel, head_chunks=head_chunks)
    if not plan.packed:
        return attention(q, k, v, mesh, causal=True, softmax_scale=scaling)
    plain = [i for i, bnd in enumerate(plan.row_bounds) if not bnd]
    pieces: dict[int, torch.Tensor] = {}
    if plain:
        idx = torch.tensor(plain, device=q.device)
        o = attention(q[idx], k[idx], v[idx], mesh, causal=True, softmax_scale=scaling)
        for j, i in enumerate(plain):
            pieces[i] = o[j : j + 1]
    for i, bnd in enumerate(plan.row_bounds):
        if bnd:
            cu = [0, *bnd, plan.full_len]
            pieces[i] = attention(
                q[i : i + 1], k[i : i + 1], v[i : i + 1], mesh, causal=True, softmax_scale=scaling, cu_seqlens=cu,
            )
    return torch.cat([pieces[i] for i in range(q.shape[0])], dim=0)


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
        run = sp_mamba2_forward if type(self).__name__ in MAMBA2_CLASSES else sp_gated_delta_forward
        return run(self, hidden_states, attention_mask, plan.row_bounds, state.mesh)

    return forward
