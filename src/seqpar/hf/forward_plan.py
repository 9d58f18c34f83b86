"""The per-forward plan of a sequence-parallel model: what one forward needs to know about the FULL sequence
(its length, where packed documents start), derived once per forward by a pre-hook on the decoder backbone,
identically on every SP rank (from the FULL position_ids, gathered over the SP group: pitfall 7). The plan
reaches the attention functions through the layer kwargs, and through the per-model state (`SPState`) when a
model does not forward unknown kwargs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import validate_cu_seqlens
from ..data import document_starts
from ..errors import SeqParError
from ..layout import check_length, local_positions, unshard
from ..mesh import SequenceParallelMesh

__all__ = ["ForwardPlan", "SPState", "PLAN_KWARG", "make_plan", "make_backbone_hook"]

PLAN_KWARG = "seqpar_plan"
_CU_KWARGS = ("cu_seqlens", "cu_seq_lens_q")


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward needs to know about the FULL sequence; identical on all SP ranks."""

    full_len: int
    # Per row: inner document boundaries in the full sequence (empty tuple = one document).
    row_bounds: tuple[tuple[int, ...], ...]

    @property
    def packed(self) -> bool:
        return any(self.row_bounds)


class SPState:
    """Per-model state: the mesh, the registered name and what remove_sequence_parallel restores."""

    def __init__(self, mesh: SequenceParallelMesh, name: str, kernel: str = "auto", head_chunks: int = 1):
        self.mesh = mesh
        self.name = name
        self.kernel = kernel  # seqpar.attention's kernel= for this model's attention calls
        self.head_chunks = head_chunks  # and its head_chunks=
        self.plan: ForwardPlan | None = None  # fallback for models that drop unknown kwargs
        self.kwarg_seen = False  # whether the last forward's plan reached attention via kwargs
        self.handles: list[Any] = []
        self.restore: dict[str, Any] = {}
        self.finalizer: Any = None

    def __deepcopy__(self, memo: dict) -> SPState:
        # A copy would share this model's registration (and mesh process groups): refuse clearly.
        raise SeqParError(
            "cannot deep-copy a model with sequence parallelism applied: copy it before "
            "apply_sequence_parallel (or after remove_sequence_parallel), then apply SP to each copy"
        )


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


def make_plan(state: SPState, kwargs: dict) -> ForwardPlan:
    """The plan of the forward the backbone is called with (`kwargs`); every check raises alike on every SP
    rank (shapes first, then one small integer gather so all ranks decide on the same full positions)."""
    mesh = state.mesh
    b, s_loc, pos = _local_inputs(kwargs, mesh)
    full_len = s_loc * mesh.sp_size
    check_length(full_len, mesh)  # same on every rank: raises before the gather below
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (b, s_loc)):
        raise SeqParError(
            f"attention_mask must be a 2-D padding mask [B, S_local]=[{b}, {s_loc}] under SP, got "
            f"{tuple(mask.shape)}; better: drop it (the seqpar collator pads on the right, which causal "
            "attention never looks at)"
        )
    stacked = torch.stack([pos, mask.long().to(pos.device)]) if mask is not None else pos[None]
    # One small integer gather per forward, so all SP ranks take the same decisions (no rank may raise alone).
    full = unshard(stacked.to(mesh.comm_device), mesh, dim=2) if mesh.sp_size > 1 else stacked
    full_pos = full[0]
    if mask is not None:
        _refuse_left_padding(full[1] != 0)
    return ForwardPlan(full_len=full_len, row_bounds=_row_bounds(full_pos, kwargs, mesh))


def _local_inputs(kwargs: dict, mesh: SequenceParallelMesh) -> tuple[int, int, torch.Tensor]:
    """(B, S_local, position_ids [B, S_local] long) of this rank's shard, checked."""
    ids = kwargs.get("input_ids")
    emb = kwargs.get("inputs_embeds")
    ref = ids if ids is not None else emb
    if ref is None:
        raise SeqParError("the model got neither input_ids nor inputs_embeds")
    b, s_loc = int(ref.shape[0]), int(ref.shape[1])
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
    return b, s_loc, pos.expand(b, s_loc).long()


def _refuse_left_padding(m: torch.Tensor) -> None:
    """Right padding only: after the first masked token of a FULL row nothing may be unmasked again."""
    bad = (m[:, 1:] & ~m[:, :-1]).any(dim=1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise SeqParError(
            f"attention_mask row {row} is not right-padded (left padding or holes): under SP attention "
            "uses no padding mask, so pad on the right (seqpar.data.SequenceParallelCollator does) "
            "and mark padding with label -100"
        )


def _row_bounds(full_pos: torch.Tensor, kwargs: dict, mesh: SequenceParallelMesh) -> tuple[tuple[int, ...], ...]:
    """Per row, the inner document starts: from the full position_ids, or the explicit cu_seqlens (B=1), which
    must then name every restart of the positions."""
    b, full_len = full_pos.shape
    cu = _explicit_cu(kwargs)
    derived = [_bounds_of(full_pos[i]) for i in range(b)]
    if cu is None:
        _refuse_local_positions(full_pos, mesh, derived)
        return tuple(derived)
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
    return (inner,)


def make_backbone_hook(state_ref: weakref.ReferenceType) -> Any:
    """The decoder backbone's forward pre-hook: makes the plan and hands it to the layers (kwarg and state)."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        state: SPState | None = state_ref()
        if state is None:
            return args, kwargs
        if args:
            # Transformers calls the backbone with keywords; positional input_ids is the first argument.
            kwargs = {**kwargs, "input_ids": args[0]}
            args = ()
        plan = make_plan(state, kwargs)
        state.plan = plan
        state.kwarg_seen = False
        kwargs = dict(kwargs)
        kwargs[PLAN_KWARG] = plan
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False  # a KV cache of local shards is useless under SP
        elif "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return args, kwargs

    return hook
