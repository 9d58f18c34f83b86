"""What a layer of a planner.families model keeps for backward, per local token, from its LayerShape: its norms,
its recurrent mixer (planner.recurrent_memory), its softmax attention (Falcon-H1's beside the mixer; a Zamba2
hybrid layer's use of the shared block, whose attention reads [x, embeddings] 2h wide) and its MLP (dense, MoE by
planner.moe, or none: Mamba's blocks). Per layer kind ("recurrent", "attention") the mean over the layers of that
kind, as planner.layer takes a hybrid's kinds."""

from __future__ import annotations

from typing import Any

from .families import LayerShape

__all__ = ["family_layer_bytes", "family_mlp_bytes", "family_mlp_kind", "kind_layers", "layer_mlp_bytes"]


def kind_layers(m: Any, kind: str) -> list[LayerShape]:
    """The layers of a kind ("mean": all): "recurrent" (the mixer's), "attention" (softmax only)."""
    if kind == "mean":
        return list(m.family.layers)
    return [lay for i, lay in enumerate(m.family.layers) if m.block_kind(i) == kind] or list(m.family.layers)


def family_mlp_kind(m: Any, kind: str) -> str:
    """The MLP most layers of a kind hold: "dense", "moe" or "none"."""
    mlps = [lay.mlp for lay in kind_layers(m, kind)]
    return max(("dense", "moe", "none"), key=mlps.count)


def layer_mlp_bytes(m: Any, wl: Any, lay: LayerShape) -> int:
    e, fam = wl.elt, m.family
    if lay.mlp == "moe":
        return fam.moe.saved_bytes(e, m.hidden)
    if lay.mlp == "dense":  # gate, up (SiLU's input and output), the product (down_proj's input)
        return e * fam.dense_intermediate * 4
    return 0


def family_mlp_bytes(m: Any, wl: Any, kind: str) -> int:
    layers = kind_layers(m, kind)
    return sum(layer_mlp_bytes(m, wl, lay) for lay in layers) // len(layers)


def _norm(h: int, e: int) -> int:
    """An RMSNorm whose output a trained projection reads: fp32 input, rsqrt, normalised x, output."""
    return 4 * h + 4 + 2 * e * h


def _layer(m: Any, wl: Any, u: int, ring: int, lay: LayerShape, soft: int, rec: int) -> int:
    e, h = wl.elt, m.hidden
    norms = lay.norms if lay.norms is not None else 1 if m.model_type == "zamba2" else sum(
        1 for t in lay.tensors if t == h)
    out = norms * _norm(h, e) + layer_mlp_bytes(m, wl, lay)
    if lay.recurrent:
        out += rec
    if lay.attention:
        out += soft
    if lay.attention and lay.recurrent and m.model_type == "zamba2":  # the shared block's use: its norms (2h, h),
        i = m.family.dense_intermediate  # MLP (fused gate_up: its output, the product), `linear`'s input
        out += _norm(2 * h, e) + _norm(h, e) + e * i * 4 + e * h
    return out


def family_layer_bytes(m: Any, wl: Any, u: int, ring: int, kind: str, soft: int, rec: int) -> int:
    """Mean saved bytes per local token over the layers of a kind; soft / rec: one softmax attention's / one
    recurrent mixer's (planner.layer / planner.recurrent_memory)."""
    layers = kind_layers(m, kind)
    return sum(_layer(m, wl, u, ring, lay, soft, rec) for lay in layers) // len(layers)
