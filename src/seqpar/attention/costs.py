"""What one SP attention call costs in theory: bytes each rank sends and causal FLOPs per ring rank.

Pure functions, no processes. Shared by the planner (its time and collective models) and the attention
benchmark (which compares its measured bytes and load balance against them).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["ulysses_theory", "ring_theory", "usp_theory", "flops_per_rank", "load_balance_table", "AttentionComm",
           "attention_comm"]

# --------------------------------------------------------------------------------------------------
# Theory. All numbers are bytes SENT by one rank for one attention call.
# --------------------------------------------------------------------------------------------------


def ulysses_theory(seq: int, batch: int, hq: int, hkv: int, d: int, p: int, elt: int) -> int:
    """One pass (fwd or bwd) of Ulysses: q, k, v go seq->heads, out comes back: (P-1)/P of each local tensor."""
    if p == 1:
        return 0
    per_token_heads = hq + 2 * hkv + hq
    return (p - 1) * (seq // p) * batch * per_token_heads * d * elt // p


def ring_theory(seq: int, batch: int, hkv: int, d: int, r: int, elt: int, grad_elt: int = 4) -> dict[str, int]:
    """Ring over r ranks, each holding seq/r tokens of hkv heads.

    fwd: K and V travel r-1 hops. bwd (seqpar's schedule): K and V again r-1 hops, and dK/dV (in the
    fp32 accumulation dtype) r-1 hops: each rank keeps its own block's gradient and the partial sums
    travel a reduce-scatter ring. bwd_min: the strict lower bound, r-1 hops (equal to bwd since the
    R-1 schedule; kept as its own key so the benchmark's ratio names what it compares to).
    """
    if r == 1:
        return {"fwd": 0, "bwd": 0, "bwd_min": 0}
    blk = (seq // r) * batch * hkv * d
    kv = (r - 1) * 2 * blk * elt
    dkv = (r - 1) * 2 * blk * grad_elt
    return {"fwd": kv, "bwd": kv + dkv, "bwd_min": kv + dkv}


def usp_theory(
    seq: int, batch: int, hq: int, hkv: int, d: int, u: int, r: int, elt: int, grad_elt: int = 4
) -> dict[str, int]:
    """USP = Ulysses over u ranks on a seq/(u*r) shard, then a ring over r ranks with hkv/u kv heads each."""
    uly = ulysses_theory(seq // r, batch, hq, hkv, d, u, elt)
    ring = ring_theory(seq, batch, hkv, d, r, elt, grad_elt)  # all kv heads; each ulysses rank moves 1/u
    return {
        "ulysses_fwd": uly,
        "ulysses_bwd": uly,
        "ring_fwd": ring["fwd"] // u,
        "ring_bwd": ring["bwd"] // u,
        "ring_bwd_min": ring["bwd_min"] // u,
    }


# --------------------------------------------------------------------------------------------------
# Load balance from the ring's piece plan (pure computation, no processes).
# --------------------------------------------------------------------------------------------------


def flops_per_rank(seq: int, r: int, layout: str, heads: int, d: int, batch: int = 1,
                   bounds: tuple[int, ...] | None = None) -> list[float]:
    """Causal forward attention FLOPs each ring rank executes, from ring.plan_pieces (what the ring runs).
    bounds: a packed row's inner document starts (cu_seqlens without its ends): attention per document, each
    rank's share of it as the layout places the documents (a long document beside short ones can load one rank
    more than the others)."""
    from ..layout import ring_segments
    from .pieces import piece_flops, plan_pieces

    segs = [ring_segments(seq, r, j, layout) for j in range(r)]
    inner = list(bounds) if bounds else None
    return [
        sum(piece_flops(plan_pieces(segs[me], segs[j], True, inner), batch, heads, d) for j in range(r))
        for me in range(r)
    ]


@dataclass(frozen=True)
class AttentionComm:
    """The attention collectives one rank issues for one micro-batch: (calls, bytes sent) per kind."""

    ulysses: tuple[int, int] = (0, 0)  # all-to-alls in the ulysses group
    ring: tuple[int, int] = (0, 0)  # K/V (and dK/dV) point-to-point hops in the ring group


def attention_comm(seq: int, rows: int, hq: int, hkv: int, d: int, u: int, r: int, elt: int, fwds: int,
                   layers: int) -> AttentionComm:
    """Per softmax-attention layer and forward pass: Ulysses 2 all-to-alls (q, k, v fused out; the output back),
    ring 2 (r-1) sends (K and V); per backward: Ulysses 2 all-to-alls, ring 2 (r-1) K/V sends plus r-1 dK/dV
    sends. hq / hkv: the heads the Ulysses exchange moves (attention.ulysses.sent_heads); fwds: forward passes
    (the policy's, its recomputation, a DPO reference's); seq: the full (padded) length of `rows` rows."""
    uly = ring = (0, 0)
    if u > 1:
        one = ulysses_theory(seq // r, rows, hq, hkv, d, u, elt)
        uly = (2 * layers * (fwds + 1), one * layers * (fwds + 1))
    if r > 1:
        t = ring_theory(seq, rows, hkv, d, r, elt)
        calls = layers * (2 * (r - 1) * fwds + 2 * (r - 1) + (r - 1))
        ring = (calls, layers * (t["fwd"] * fwds + t["bwd"]) // u)
    return AttentionComm(uly, ring)


def load_balance_table(seq: int, heads: int, d: int, degrees: tuple[int, ...] = (2, 4, 8)) -> list[dict[str, Any]]:
    rows = []
    for r in degrees:
        for layout in ("contiguous", "zigzag"):
            f = flops_per_rank(seq, r, layout, heads, d)
            rows.append(
                {
                    "ring_degree": r,
                    "layout": layout,
                    "flops_per_rank": f,
                    "max_over_mean": max(f) / statistics.fmean(f),
                    "expected_max_over_mean": (2 * r - 1) / r if layout == "contiguous" else 1.0,
                }
            )
    return rows
