"""`seqpar plan`'s per-layer-kind report for a planner.families model, at a candidate's length and mesh: each
kind's layers, parameters (a shared block's once, apart), what its mixer keeps for backward per local token, the
state one SP boundary passes per row and the ring traffic of one layer and pass, forward FLOPs per local token."""

from __future__ import annotations

from typing import Any

from .collectives import ring_boundary_bytes
from .family_memory import layer_mlp_bytes
from .layer import attention_bytes
from .recurrent_memory import mixer_saved_bytes
from .spans import FULL
from .time import attention_flops

__all__ = ["layer_kind_rows", "layer_kind_lines"]


def layer_kind_rows(m: Any, wl: Any, cand: Any) -> list[dict[str, Any]]:
    """One dict per layer label (planner.families.FamilyFacts.kinds), at the candidate's length and mesh."""
    if m.family is None:
        return []
    from dataclasses import replace

    lay, seq = cand.layout, cand.seq_len
    wl = replace(wl, seq_len=seq)
    u, r, e, f = lay.ulysses, lay.ring, wl.elt, m.recurrent
    tokens = wl.rows * seq / lay.sp
    halo, state, _ = ring_boundary_bytes(f, u, 1, e) if f is not None else (0, 0, 0)
    rec_saved = mixer_saved_bytes(f, e, u, r, seq, wl.rows) if f is not None else 0
    soft_saved = attention_bytes(m, wl, u, r, "attention")
    rows, counts = [], m.family.kinds()
    for label, n in counts.items():
        soft_flops = _soft_flops(m, wl, lay, label) / tokens
        shape = next(x for x in m.family.layers if x.label == label)
        saved = ((rec_saved if shape.recurrent else 0) + (soft_saved if shape.attention else 0)
                 + layer_mlp_bytes(m, wl, shape))
        flops = 2 * shape.active + (f.flops_per_token() if shape.recurrent and f else 0) + (
            soft_flops if shape.attention else 0)
        hops = (2 * r - 2) if shape.recurrent and f is not None and f.has_state and r > 1 else 0
        rows.append({"kind": label, "layers": n, "params_per_layer": sum(shape.tensors),
                     "saved_bytes_per_token": saved,
                     "state_bytes_per_boundary": state if shape.recurrent and f is not None and f.has_state else 0,
                     "ring_state_bytes_per_pass": hops * state * wl.rows,
                     "halo_bytes_per_pass": halo * wl.rows * (r - 1) if shape.recurrent and r > 1 else 0,
                     "fwd_flops_per_token": flops})
    return rows


def _soft_flops(m: Any, wl: Any, lay: Any, label: str) -> float:
    """Forward attention FLOPs of one layer of this label on the busiest rank: the mean over its softmax attention
    layers, each at its own span (RecurrentGemma's local attention: its window)."""
    idx = [i for i, x in enumerate(m.family.layers) if x.label == label and x.attention]
    spans = [m.spans[i] if i < len(m.spans) else FULL for i in idx]
    return sum(attention_flops(m, wl, lay, s) for s in spans) / len(spans) if spans else 0.0


def layer_kind_lines(m: Any, wl: Any, cand: Any) -> list[str]:
    rows = layer_kind_rows(m, wl, cand)
    if not rows:
        return []
    lay = cand.layout
    out = [f"layer kinds at {cand.seq_len} tokens on ulysses {lay.ulysses} x ring {lay.ring} (per local token: "
           "the mixers' and MLP's saved bytes, forward FLOPs; state: fp32 bytes one SP boundary passes per row; "
           "ring: bytes one layer's forward pass sends over the ring, every rank's hops):"]
    for x in rows:
        out.append(f"  layer kind {x['kind']}: {x['layers']} layers x {x['params_per_layer'] / 1e6:.2f}M params, "
                   f"saved {x['saved_bytes_per_token']} B/token, state {x['state_bytes_per_boundary']} B, ring "
                   f"{x['ring_state_bytes_per_pass'] + x['halo_bytes_per_pass']} B/pass, "
                   f"{x['fwd_flops_per_token'] / 1e6:.2f} MFLOP/token")
    if m.family.shared:
        out.append(f"  shared blocks (counted once): {sum(m.family.shared) / 1e6:.2f}M params, run by every "
                   "'shared attention block' layer")
    return out
