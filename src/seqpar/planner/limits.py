"""What lengths `seqpar train` accepts for a model and a mesh: the context limit (max_position_embeddings,
unless the user extends it; a sliding window is no limit: its layers are priced by planner.spans) and the
padding of a length to a mesh's split (the collator pads, `dataset.max_length` must be a multiple)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SeqParError
from ..layout import required_multiple, round_up_length
from .memory import Layout
from .model import ModelFacts

__all__ = ["Context", "context_limit", "padded", "split_multiple", "refuse_too_long"]


@dataclass(frozen=True)
class Context:
    """The longest sequence the model accepts and why (None: no limit known)."""

    limit: int | None
    reason: str
    extended: bool = False  # the user extended the model's positions (--max-position / --rope-scaling)
    max_position: int | None = None  # what config.json's max_position_embeddings must say for the run
    rope_factor: float | None = None


def context_limit(m: ModelFacts, max_position: int | None = None, rope_scaling: float | None = None) -> Context:
    """max_position: the max_position_embeddings of an extended config (ALST and TRL's million-token runs
    raise it, with RoPE scaling); rope_scaling: a factor on the model's own max_position_embeddings."""
    if max_position is not None and max_position < 1:
        raise SeqParError(f"--max-position must be positive, got {max_position}")
    if rope_scaling is not None and rope_scaling < 1:
        raise SeqParError(f"--rope-scaling must be a factor >= 1, got {rope_scaling}")
    pos, why, extended = m.max_positions, "the model's max_position_embeddings", False
    if rope_scaling is not None:
        if pos is None:
            raise SeqParError(f"--rope-scaling: model {m.name!r} has no max_position_embeddings to scale: "
                              "give --max-position N instead")
        why = f"max_position_embeddings {pos} x --rope-scaling {rope_scaling:g}"
        pos, extended = int(pos * rope_scaling), True
    if max_position is not None:
        pos, why, extended = max_position, "--max-position", True
    return Context(pos, why, extended, pos if extended else None, rope_scaling)


def refuse_too_long(ctx: Context, seq_len: int) -> None:
    if ctx.limit is not None and seq_len > ctx.limit:
        fix = ("extend the context as a long-context run does: --max-position N (a config.json with a larger "
               "max_position_embeddings) or --rope-scaling FACTOR")
        raise SeqParError(f"--seq-len {seq_len} exceeds {ctx.limit}, {ctx.reason}: seqpar train refuses it; "
                          f"use --seq-len <= {ctx.limit}, or {fix}")


def split_multiple(lay: Layout, layout: str = "zigzag") -> int:
    """A mesh splits lengths that are multiples of this (zigzag ring: 2 x ring x ulysses; contiguous ring or no
    ring: ring x ulysses). layout: the run's sequence_parallel.layout (seqpar train's default: zigzag)."""
    return required_multiple(lay.ring, lay.ulysses, layout)


def padded(seq_len: int, lay: Layout, layout: str = "zigzag") -> int:
    """The length seqpar runs a row of `seq_len` tokens at on this mesh: the collator pads it to the split's
    multiple (seqpar.layout.round_up_length, the one rounding rule), and `dataset.max_length` must be that
    multiple."""
    return round_up_length(seq_len, lay.ring, lay.ulysses, layout)
