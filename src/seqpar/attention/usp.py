"""USP: Ulysses all-to-all inside each ring rank's sequence, ring attention across ring ranks.

A world of 1 is the local attention (attention.local). Pure Ulysses is ring=1; pure ring is ulysses=1.
Ulysses' q/k/v go seq->heads in ONE fused all-to-all (ulysses_fused); pure Ulysses (ring=1) runs the local
kernel inside the fused exchange, 2 collectives per pass (optionally split into `overlap_chunks` head
chunks whose exchanges overlap compute), on the original heads with uneven per-rank head sets
(`ulysses.rank_heads`: dummy heads only where a GQA group needs them). With a ring (USP) the same uneven
head sets go through one all-to-all each way around the ring attention: Ulysses rank u holds the same heads
on every ring rank, so the ring's blocks line up, and a Ulysses rank the plan leaves without heads skips
the ring (its ring peers hold none either).
"""

from __future__ import annotations

import torch

from ..layout import ring_segments
from ..mesh import SequenceParallelMesh
from .kernels import AttentionKernel
from .local import local_attention, local_calls
from .ring import ring_attention
from .sinks import sinks_for_heads
from .ulysses import head_plan, rank_heads
from .ulysses_fused import from_rank_heads, fused_ulysses_attention, to_rank_heads

__all__ = ["usp_attention"]


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: SequenceParallelMesh,
    seq_len: int,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    bounds: list[int] | None = None,
    overlap_chunks: int = 1,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, S/sp, Hq, D], k/v [B, S/sp, Hkv, D] in the mesh's layout -> out [B, S/sp, Hq, D]. `window`: a causal
    sliding window of that many tokens (None: none); `sinks` [Hq]: each q head's sink logit (None: none)."""
    dev = mesh.comm_device
    calls = local_calls(seq_len, causal, bounds, kernel, q.shape[0], window) if mesh.ring_degree == 1 else None
    if mesh.sp_size == 1 and calls is not None:  # a world of 1: straight to the kernel, no merge, no copies
        return local_attention(q, k, v, kernel, calls, scale, sinks)
    if mesh.ulysses_degree > 1:
        plan = head_plan(q.shape[2], k.shape[2], mesh.ulysses_degree)
        if calls is not None:  # the original heads go in: the exchange places (and pads only where needed)
            return fused_ulysses_attention(
                q, k, v, mesh.ulysses_group, plan, causal, scale, kernel, calls, mesh.stats, dev, overlap_chunks,
                sinks,
            )
        q_shape = q.shape
        q, k, v = to_rank_heads(q, k, v, mesh.ulysses_group, plan, mesh.stats, dev)
        if sinks is not None:  # the sinks of the heads this Ulysses rank now holds (differentiable)
            sinks = sinks_for_heads(sinks, rank_heads(plan)[mesh.ulysses_rank].q)
    layout = mesh.effective_layout
    all_segs = [ring_segments(seq_len, mesh.ring_degree, j, layout) for j in range(mesh.ring_degree)]
    if q.shape[2] == 0:  # no heads here (nor on this rank's ring peers): the ring has nothing to do
        out = q.clone()  # zero elements, but on the graph: backward still joins the Ulysses exchanges
    else:
        out = ring_attention(
            q, k, v, mesh.ring_group, all_segs, mesh.ring_rank, causal, scale, kernel, bounds, mesh.stats, dev,
            window, sinks,
        )
    if mesh.ulysses_degree > 1:
        out = from_rank_heads(out, mesh.ulysses_group, plan, q_shape, mesh.stats, dev)
    return out
