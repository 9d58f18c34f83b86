"""The cost of one micro-batch on each rank of its SP group: the planner's step-time model per micro-batch,
written once here and used by `seqpar train`'s length-aware balancing (train/loop/dynamic.py) and by `seqpar
plan --lengths` (planner/dynamic.py), which both build a `RowCost` and call `rank_seconds`.

Terms (the planner's time model, docs/planner.md "Time model"):
- everything linear in the rank's tokens: matmuls of every pass, memory-bound streaming, the loss
  (`DegreeCost.token_s`, per degree: the saved activations per token depend on the split);
- causal attention per DOCUMENT from the ring's own piece plan (attention.costs.flops_per_rank with the packed
  row's document starts): each rank's share, x the forward / recompute / backward multiple, at the machine's
  attention rate for the document's length (a hybrid's recurrent layers: per token, at that rate too);
- the collectives of degree d (Ulysses all-to-alls, ring hops, the plan's all-gather, a hybrid's halo and
  state passing): per micro-batch calls x latency + bytes / bandwidth, bytes proportional to the tokens; with
  overlap (GPUs) ring hops hide behind attention, as in the planner;
- the host's fixed cost per micro-batch (python per layer and pass), and FSDP2's all-gathers of the weights
  per micro-batch (hidden behind compute with overlap);
- `step_s`: what a step costs once whatever its micro-batches (optimizer, gradient sums): not balanced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..attention.costs import flops_per_rank
from ..attention.ulysses import head_plan
from ..layout import round_up_length

__all__ = ["Machine", "CommLine", "DegreeCost", "RowCost", "causal_flops"]


@dataclass(frozen=True)
class Machine:
    """What a micro-batch's cost needs from the machine (planner.gpus.Cluster builds one from its fields)."""

    gpus_per_node: int = 8
    intra_bw: float = 360.0  # GB/s per rank, inside a node
    inter_bw: float = 45.0  # GB/s per rank, across nodes
    latency_s: float = 2e-5  # one collective call's fixed cost
    overlap: bool = True  # communication hides behind compute (separate streams)
    host_layer_s: float = 0.0  # host cost per layer and pass
    attn_tflops: float | None = None  # achieved attention FLOP/s; None: the matmul rate
    attn_by_len: tuple[tuple[int, float], ...] = ()  # measured: (kernel length, TFLOP/s), log-interpolated
    per_kind: tuple[tuple[str, float, float], ...] = ()  # measured: (kind, latency s, GB/s) per collective kind

    def bw(self, group: int, stride: int = 1) -> float:
        """Bandwidth of a group of `group` ranks spaced `stride` apart (ranks fill nodes in order)."""
        return self.intra_bw if group * stride <= self.gpus_per_node else self.inter_bw

    def attention_tflops(self, length: int) -> float | None:
        """The attention kernel's rate at a query length (measured machines), else `attn_tflops`."""
        pts = sorted(self.attn_by_len)
        if not pts:
            return self.attn_tflops
        if length <= pts[0][0]:
            return pts[0][1]
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if length <= n1:
                w = math.log(length / n0) / math.log(n1 / n0)
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def collective_s(self, kind: str, calls: int, nbytes: float, group: int, stride: int = 1) -> float:
        """Seconds for `calls` collectives of one kind that send `nbytes` in all: latency + bytes / bandwidth."""
        for k, lat, gbs in self.per_kind:
            if k == kind:
                return calls * lat + nbytes / (gbs * 1e9)
        return calls * self.latency_s + nbytes / (self.bw(group, stride) * 1e9)


@dataclass(frozen=True)
class CommLine:
    """One kind of collective of one micro-batch: calls, and bytes sent per token of the rank's shard."""

    what: str  # ulysses | ring | plan | ulysses_recurrent | halo | state
    kind: str  # all_to_all | p2p | all_gather (planner.collectives.KINDS)
    group: int  # ranks in the group
    stride: int  # their spacing
    calls: int
    bytes_per_token: float


@dataclass(frozen=True)
class DegreeCost:
    """The per-degree coefficients of a RowCost."""

    ulysses: int
    ring: int
    token_s: float  # seconds per token of the rank's shard: matmuls, memory streaming, the loss
    comm: tuple[CommLine, ...] = ()
    host_s: float = 0.0  # fixed per micro-batch
    fsdp_s: float = 0.0  # FSDP2's all-gathers of one micro-batch
    rec_flops_per_token: float = 0.0  # a hybrid's recurrent layers, forward FLOPs per local token (all of them)


def causal_flops(n: int, heads: int, head_dim: int) -> float:
    """Forward FLOPs of one causal attention over n tokens (attention.pieces.piece_flops' diagonal)."""
    return 4.0 * heads * head_dim * n * (n + 1) / 2


@dataclass(frozen=True)
class RowCost:
    """The cost model of a micro-batch (module docstring). `rank_seconds(rows, d)`: rows = the micro-batch's
    sequences, each a list of its document lengths (one document: an unpacked row); every sequence is padded
    to the longest one's length rounded up to the split of degree d (the collators' rule)."""

    degrees: tuple[tuple[int, DegreeCost], ...]
    heads: int
    kv_heads: int
    head_dim: int
    attn_layers: int
    attn_mult: float  # forward-attention equivalents per step: forward passes (+ recompute - kept) + 2.5 backward
    matmul_flops_s: float  # what attention runs at when the machine knows no attention rate
    layout: str = "zigzag"
    machine: Machine = Machine()
    step_s: float = 0.0  # per step, whatever the micro-batches

    def degree(self, d: int) -> DegreeCost:
        for k, c in self.degrees:
            if k == d:
                return c
        raise KeyError(f"the cost model has no degree {d} (it has {[k for k, _ in self.degrees]})")

    def full_length(self, rows: Sequence[Sequence[int]], d: int) -> int:
        c = self.degree(d)
        return round_up_length(max(sum(r) for r in rows), c.ring, c.ulysses, self.layout)

    def local_tokens(self, rows: Sequence[Sequence[int]], d: int) -> int:
        return len(rows) * self.full_length(rows, d) // d

    def rank_seconds(self, rows: Sequence[Sequence[int]], d: int, packed: bool = True) -> list[float]:
        """Seconds of the micro-batch on each rank of its degree-d group, in SP rank order. packed: the padding
        is a document of its own (the packing collator's rule), else it extends each row's last document (an
        unpacked row's right padding, which causal attention computes over)."""
        c = self.degree(d)
        full = self.full_length(rows, d)
        tokens = len(rows) * full // d
        attn = self._attention_s(rows, full, c, packed)  # per ring rank
        fixed = c.token_s * tokens + c.host_s
        comm, ring_s = 0.0, 0.0
        for line in c.comm:
            s = self.machine.collective_s(line.kind, line.calls, line.bytes_per_token * tokens, line.group,
                                          line.stride)
            if line.what == "ring":
                ring_s += s
            else:
                comm += s
        out = []
        for a in attn:
            ring = max(0.0, ring_s - a) if self.machine.overlap else ring_s
            compute = fixed + a
            fsdp = max(0.0, c.fsdp_s - compute) if self.machine.overlap else c.fsdp_s
            out.append(compute + comm + ring + fsdp)
        return [out[s // c.ulysses] for s in range(d)]

    def seconds(self, rows: Sequence[Sequence[int]], d: int, packed: bool = True) -> float:
        """The group's time: its slowest rank (the others wait for it at every layer's collectives)."""
        return max(self.rank_seconds(rows, d, packed))

    def _attention_s(self, rows: Sequence[Sequence[int]], full: int, c: DegreeCost, packed: bool) -> list[float]:
        """Seconds of attention (and a hybrid's recurrences) per ring rank of the group."""
        hq = head_plan(self.heads, self.kv_heads, c.ulysses).padded_heads if c.ulysses > 1 else self.heads
        per_rank = [0.0] * c.ring
        weighted = total = 0.0
        for docs in rows:
            lengths = _with_padding([n for n in docs if n > 0], full, packed)
            for n in lengths:  # the kernel's rate depends on the document's length (measured machines)
                f = causal_flops(n, hq, self.head_dim)
                total += f
                weighted += f / self._rate(n)
            if c.ring == 1:
                f_row = sum(causal_flops(n, hq, self.head_dim) for n in lengths)
                per_rank[0] += f_row
                continue
            bounds = tuple(_starts(lengths))
            for j, f in enumerate(flops_per_rank(full, c.ring, self.layout, hq, self.head_dim, 1, bounds)):
                per_rank[j] += f
        rate = total / weighted if weighted > 0 else self.matmul_flops_s
        tokens = len(rows) * full // (c.ring * c.ulysses)
        rec = c.rec_flops_per_token * tokens
        return [(f / c.ulysses * self.attn_layers + rec) * self.attn_mult / rate for f in per_rank]

    def _rate(self, length: int) -> float:
        t = self.machine.attention_tflops(length)
        return t * 1e12 if t else self.matmul_flops_s


def _with_padding(lengths: list[int], full: int, packed: bool) -> list[int]:
    pad = full - sum(lengths)
    if pad <= 0:
        return lengths
    return lengths + [pad] if packed or not lengths else lengths[:-1] + [lengths[-1] + pad]


def _starts(lengths: Sequence[int]) -> list[int]:
    """Inner document starts of a packed row of these document lengths."""
    out, pos = [], 0
    for n in lengths[:-1]:
        pos += n
        out.append(pos)
    return out
