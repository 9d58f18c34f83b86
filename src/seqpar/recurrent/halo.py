"""The causal conv's history across segments: a (kernel_size - 1)-token halo from the tokens before a segment.

A depthwise causal conv of kernel K reads, for output t, the inputs t-K+1 .. t. A segment that starts at
global position g therefore needs the K-1 inputs before g, which another ring rank holds (zigzag: the chunk
before g in global order). Every rank puts the last min(K-1, chunk length) inputs of each of its segments
into one all-gather over the ring group (differentiable: its backward sums every rank's gradient back onto the
owner of those inputs); each rank then builds its halos from the chunks before its segments (several chunks
when they are shorter than K-1) and zeroes the halo tokens before the document the segment's first token
belongs to (packed documents restart the conv as they restart the state; before position 0: zeros, the
conv's own zero padding). The conv itself is the caller's (the model's own function, padding zeros on the
left): conv(cat(halo, x))[K-1:] is exactly the conv of x with that history.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import comm
from ..mesh import SequenceParallelMesh
from .segments import RingPlan

__all__ = ["gather_halos", "conv_with_halo"]


def _tails(x: torch.Tensor, plan: RingPlan, width: int) -> torch.Tensor:
    """[n_segments, B, width, C]: the last `width` inputs of each local segment (segments are >= width long)."""
    ends = [off + n for off, (_, n) in zip(plan.offsets(), plan.segments)]
    return torch.stack([x[:, e - width : e] for e in ends])


def gather_halos(x: torch.Tensor, plan: RingPlan, kernel_size: int,
                 mesh: SequenceParallelMesh) -> tuple[list[torch.Tensor | None], torch.Tensor | None]:
    """Per local segment: [B, K-1, C] inputs before it (zeros outside its document), None at position 0; and
    the gathered tails (None without a gather), which the caller ties after its other collectives (combine.tie).

    x: [B, n, C] this ring rank's pre-conv inputs in local order. Collective over the ring group (every rank
    calls it, whatever its segments need)."""
    k1 = kernel_size - 1
    if k1 == 0 or plan.ring_degree == 1:
        return [None] * len(plan.segments), None
    width = min(k1, min(n for _, n in plan.segments))
    tails = comm.all_gather(_tails(x, plan, width), mesh.ring_group, dim=0, stats=mesh.stats,
                            device=mesh.comm_device).clone()  # [R * n_seg, B, width, C]; clone: waits now
    per_rank = len(plan.segments)
    halos: list[torch.Tensor | None] = []
    for s, (g, _) in enumerate(plan.segments):
        if g == 0:
            halos.append(None)
            continue
        j, parts, have = plan.chunk_index(s), [], 0
        while have < k1 and j > 0:  # walk back over the chunks before this segment
            j -= 1
            c = plan.order[j]
            parts.insert(0, tails[c.owner * per_rank + c.local])
            have += width
        halo = torch.cat(parts, dim=1)[:, -k1:]
        if halo.shape[1] < k1:  # the sequence starts less than K-1 tokens before g
            halo = torch.cat([halo.new_zeros(halo.shape[0], k1 - halo.shape[1], halo.shape[2]), halo], dim=1)
        halos.append(halo * _history_mask(plan, g, k1, halo))
    return halos, tails


def _history_mask(plan: RingPlan, g: int, k1: int, like: torch.Tensor) -> torch.Tensor:
    """[B, K-1, 1]: 1 where the halo token (global g-K+1 .. g-1) is in the document of position g, else 0."""
    pos = torch.arange(g - k1, g)
    starts = torch.tensor([plan.doc_start(r, g) for r in range(len(plan.row_bounds))])
    return (pos[None, :] >= starts[:, None]).to(device=like.device, dtype=like.dtype)[..., None]


def conv_with_halo(conv: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   halo: torch.Tensor | None) -> torch.Tensor:
    """conv: a causal conv over [b, L, C] (zeros before its first input); x: [b, L, C]; halo: [b, K-1, C] or
    None (x starts a document). Returns conv(x) as if the halo preceded x."""
    if halo is None:
        return conv(x)
    return conv(torch.cat([halo.to(x.dtype), x], dim=1))[:, halo.shape[1]:]
