"""The recurrent / convolutional mixers of hybrid models that seqpar runs itself, by class name: how to find them,
check them against a mesh (apply time) and run their forward under SP (hf.attention_fn.make_linear_forward).

One row per layer kind; each forward has the upstream layer's math and the signature
forward(layer, hidden_states, attention_mask, row_bounds, mesh) on this rank's sequence shard (and position_ids=, the
shard's global positions, for a kind with `positions`: the RG-LRU resets where they are 0).
`layer_types`: the config layer_types / layers_block_type values a model with such layers lists for them
(hf.mixers refuses any other non-attention value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..mesh import SequenceParallelMesh
from .kda import KDA_CLASSES, check_kda, sp_kda_forward
from .lightning import LIGHTNING_CLASSES, check_lightning, sp_lightning_forward
from .linear_attention import LINEAR_ATTENTION_CLASSES, check_linear_attention, sp_gated_delta_forward
from .mamba1 import MAMBA1_CLASSES, check_mamba1, sp_mamba1_forward
from .mamba2 import MAMBA2_CLASSES, check_mamba2, sp_mamba2_forward
from .rglru import RGLRU_CLASSES, check_rglru, sp_rglru_forward
from .short_conv import SHORT_CONV_CLASSES, check_short_conv, sp_short_conv_forward

__all__ = ["RecurrentKind", "KINDS", "find_recurrent", "check_recurrent", "recurrent_forward", "wants_positions"]


@dataclass(frozen=True)
class RecurrentKind:
    classes: tuple[str, ...]
    check: Callable[[list[torch.nn.Module], SequenceParallelMesh], None]
    forward: Callable[..., torch.Tensor]
    layer_types: frozenset[str]
    positions: bool = False  # its forward takes position_ids= (the shard's global positions)


KINDS = (
    RecurrentKind(LINEAR_ATTENTION_CLASSES, check_linear_attention, sp_gated_delta_forward,
                  frozenset({"linear_attention"})),
    RecurrentKind(KDA_CLASSES, check_kda, sp_kda_forward, frozenset({"linear_attention"})),
    RecurrentKind(MAMBA2_CLASSES, check_mamba2, sp_mamba2_forward, frozenset({"linear_attention", "mamba", "hybrid"})),
    RecurrentKind(MAMBA1_CLASSES, check_mamba1, sp_mamba1_forward, frozenset({"linear_attention", "mamba"})),
    RecurrentKind(LIGHTNING_CLASSES, check_lightning, sp_lightning_forward, frozenset({"linear_attention"})),
    RecurrentKind(SHORT_CONV_CLASSES, check_short_conv, sp_short_conv_forward, frozenset({"conv"})),
    RecurrentKind(RGLRU_CLASSES, check_rglru, sp_rglru_forward, frozenset({"linear_attention"}), positions=True),
)


def _kind(layer: torch.nn.Module) -> RecurrentKind | None:
    name = type(layer).__name__
    return next((k for k in KINDS if name in k.classes), None)


def find_recurrent(model: torch.nn.Module) -> tuple[list[torch.nn.Module], frozenset[str]]:
    """The supported recurrent / conv mixers of `model` in module order, and the layer types they stand for."""
    layers = [m for m in model.modules() if _kind(m) is not None]
    types: frozenset[str] = frozenset()
    for m in layers:
        types |= _kind(m).layer_types
    return layers, types


def check_recurrent(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """SeqParError (same on every rank: config and mesh only) if SP cannot run one of these layers on `mesh`."""
    for kind in KINDS:
        kind.check([m for m in layers if type(m).__name__ in kind.classes], mesh)


def recurrent_forward(layer: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """seqpar's SP forward of a supported layer."""
    kind = _kind(layer)
    assert kind is not None, type(layer).__name__
    return kind.forward


def wants_positions(layer: torch.nn.Module) -> bool:
    """Whether the layer's SP forward takes position_ids=."""
    kind = _kind(layer)
    return kind is not None and kind.positions
