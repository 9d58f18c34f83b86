"""Which collectives one training step issues on one rank: their kind, group, calls and bytes.

The time model charges each collective `calls x latency + bytes / bandwidth`, so the counts matter as
much as the bytes when messages are small (gloo on a CPU: ~0.2-1.6 ms a call). They follow what
`seqpar train`'s step runs (tests/test_planner.py checks every count against torch.profiler's c10d ops):

- per softmax-attention layer and forward pass: Ulysses 2 all-to-alls (q, k, v fused out; the output back), ring
  2 (r-1) sends (K and V, r-1 hops); per backward: Ulysses 2 all-to-alls, ring 2 (r-1) K/V sends plus
  r-1 dK/dV sends (one stacked buffer a hop; a reduce-scatter ring: each rank keeps its own block's
  part). Forward passes: the policy's, its recomputation under activation checkpointing, and DPO's
  reference pass (no backward); a hybrid's recurrent layers: planner.recurrent (Ulysses, conv halo, state passing);
- one small all-gather of position ids per model call (the ForwardPlan: all SP ranks decide alike);
- gradients: without FSDP, over sp and then over dp, one all-reduce per large trainable tensor (in place)
  and one for all the small ones (fp32: bf16 runs reduce the fp32 master gradients); with FSDP2 (one unit
  per decoder layer + the root) an all-gather per unit in
  forward and per layer in backward (the root stays gathered), a reduce-scatter per unit that has
  trainable parameters (fp32), and the gradient-norm all-reduce;
- book-keeping all-reduces of a few numbers: the loss (sp, dp), token counts (dp, twice), the step's
  metrics (world); DPO adds the per-sequence log-prob sums (sp: policy forward + backward, reference)
  and its metrics (dp).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.costs import attention_comm
from ..attention.ulysses import head_plan, sent_heads
from ..comm import IN_PLACE_MIN_NUMEL
from .memory import Features, Layout, Workload
from .model import ModelFacts
from .recurrent import RecurrentFacts

__all__ = ["Collective", "step_collectives", "KINDS", "ring_boundary_bytes"]

KINDS = ("all_to_all", "p2p", "all_reduce", "all_gather", "reduce_scatter")
SMALL = 8  # bytes of one book-keeping number


@dataclass(frozen=True)
class Collective:
    what: str  # ulysses | ring | plan | grads | fsdp_gather | fsdp_reduce | bookkeeping
    kind: str  # one of KINDS
    group: str  # ulysses | ring | sp | dp | world: which ranks (and so which links) it spans
    calls: int
    nbytes: int  # bytes this rank sends, all calls together


def heads_per_rank(m: ModelFacts, u: int) -> tuple[int, int]:
    """q and kv heads an Ulysses rank group works on, padded by the head plan (dummy heads, KV replication)."""
    if u == 1:
        return m.heads, m.kv_heads
    plan = head_plan(m.heads, m.kv_heads, u)
    return plan.padded_heads, plan.expanded_kv_heads


def sent_ulysses_heads(m: ModelFacts, lay: Layout) -> tuple[int, int]:
    """q and kv heads Ulysses' exchange moves over the group: the plan without the dummies an uneven split
    leaves out (ulysses.rank_heads; pure Ulysses and USP alike)."""
    if lay.ulysses == 1:
        return m.heads, m.kv_heads
    return sent_heads(head_plan(m.heads, m.kv_heads, lay.ulysses))


def passes(wl: Workload, feats: Features) -> tuple[int, int]:
    """(forward passes with a backward, forward passes without one) through the decoder per step."""
    return 1 + int(feats.activation_checkpointing), int(wl.stage == "dpo")


def _attention(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> list[Collective]:
    hq, hkv = sent_ulysses_heads(m, lay)  # the ring (USP) moves the kv heads the exchange placed
    fwd_bwd, fwd_only = passes(wl, feats)
    c = attention_comm(wl.seq_len, wl.rows, hq, hkv, m.head_dim, lay.ulysses, lay.ring, wl.elt,
                       fwd_bwd + fwd_only, m.softmax_layers)
    out: list[Collective] = []
    if lay.ulysses > 1:
        out.append(Collective("ulysses", "all_to_all", "ulysses", *c.ulysses))
    if lay.ring > 1:
        out.append(Collective("ring", "p2p", "ring", *c.ring))
    return out


def _recurrent(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> list[Collective]:
    """A hybrid's recurrent layers (planner.recurrent): Ulysses' two all-to-alls, the conv halo and the state
    passing, per forward pass and again in backward. The chain's hops wait on each other, so its calls and bytes
    are the whole chain's (each rank's critical path), not only this rank's sends."""
    rec, L = m.recurrent, m.linear_layers
    if rec is None or L == 0:
        return []
    fwd_bwd, fwd_only = passes(wl, feats)
    n = L * (fwd_bwd + fwd_only + 1)  # forward passes and the backward
    u, r, e, rows = lay.ulysses, lay.ring, wl.elt, wl.rows
    tokens = rows * wl.seq_len // lay.sp
    out: list[Collective] = []
    if u > 1:
        inward, outward = rec.ulysses_elems(u)
        out.append(Collective("ulysses_recurrent", "all_to_all", "ulysses", 2 * n,
                              n * tokens * (inward + outward) * e * (u - 1) // u))
        if rec.kind == "mamba1":  # x_proj's partial sums over the channels: dt rank + 2 n numbers per token
            out.append(Collective("ulysses_reduce", "all_reduce", "ulysses", 2 * n,
                                  n * 2 * tokens * u * (rec.extra + 2 * rec.k_dim) * e * (u - 1) // u))
    if r > 1:
        if rec.conv_kernel > 1:  # (lightning attention has no conv)
            halo = ring_boundary_bytes(rec, u, rows, e)[0] * (r - 1)  # to every other ring rank
            out.append(Collective("halo", "all_gather", "ring", n, n * halo))
        s_el, m_el = rec.state_elems(u)
        if not rec.has_state:  # short convs: a halo, no recurrence
            return out
        segs = 2  # zigzag: two segments per ring rank
        if wl.state_passing == "scan":
            out.append(Collective("state", "all_gather", "ring", n, n * rows * segs * (s_el + m_el) * 4 * (r - 1)))
        else:
            hops = 2 * r - 2  # zigzag: 2R-1 steps, the middle one (chunk R-1 -> R) on one rank
            out.append(Collective("state", "p2p", "ring", n * hops, n * hops * rows * s_el * 4))
    return out


def ring_boundary_bytes(rec: RecurrentFacts, u: int, rows: int, e: int) -> tuple[int, int, int]:
    """Per recurrent layer and forward pass on one rank of a ring of r: (bytes of the conv halo's all-gather per
    other ring rank, of one state hop, of one segment's (M, b) for the scan), for `rows` rows: the zigzag's two
    segments each send their last K-1 conv inputs (e bytes each); a state (fp32) crosses each SP boundary."""
    s_el, m_el = rec.state_elems(u)
    halo = rows * 2 * (rec.conv_kernel - 1) * (rec.conv_channels // u) * e
    return halo, rows * s_el * 4, rows * (s_el + m_el) * 4


def _gradients(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> list[Collective]:
    sizes = wl.trained_tensors(m)
    n_train = sum(sizes)
    if not feats.fsdp:  # seqpar.comm.all_reduce_many_: large gradients in place, the small ones in one buffer
        large = sum(1 for n in sizes if n >= IN_PLACE_MIN_NUMEL)
        calls = large + (1 if large < len(sizes) else 0)
        return [Collective("grads", "all_reduce", g, calls, 2 * n_train * 4 * (k - 1) // k)
                for g, k in (("sp", lay.sp), ("dp", lay.dp)) if k > 1]
    w, L = lay.world, m.layers
    if w == 1:
        return []
    gathered = m.num_params() * wl.elt  # FSDP2 all-gathers in the compute dtype
    per_layer, root = m.layer_params(), m.num_params() - L * m.layer_params()
    gather_bytes = (gathered * (w - 1) // w) + (L * per_layer * wl.elt * (w - 1) // w)  # forward + backward
    reduce_units = L + (0 if wl.lora else 1)  # LoRA: the root (embeddings, head, norm) trains nothing
    reduce_bytes = (n_train if wl.lora else L * per_layer + root) * 4 * (w - 1) // w
    out = [Collective("fsdp_gather", "all_gather", "world", 2 * L + 1, gather_bytes),
           Collective("fsdp_reduce", "reduce_scatter", "world", reduce_units, reduce_bytes),
           Collective("bookkeeping", "all_reduce", "world", 1, SMALL)]  # the sharded gradient norm
    if wl.stage == "dpo" and not wl.lora:  # the sharded frozen reference: its forward gathers each layer + root
        out.append(Collective("fsdp_ref_gather", "all_gather", "world", L + 1, gathered * (w - 1) // w))
    return out


def _bookkeeping(wl: Workload, lay: Layout) -> list[Collective]:
    sp, dp = lay.sp > 1, lay.dp > 1
    calls = {"sp": int(sp), "dp": 3 * int(dp), "world": int(lay.world > 1)}  # loss; tokens x2 + loss; metrics
    if wl.stage == "dpo":
        calls["sp"] += 3 * int(sp)  # log-prob sums: policy forward + its backward, reference
        calls["dp"] += int(dp)  # DPO metrics
    return [Collective("bookkeeping", "all_reduce", g, n, n * SMALL) for g, n in calls.items() if n]


def step_collectives(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> list[Collective]:
    """Every collective one rank issues in one optimizer step (one micro-batch)."""
    out = _attention(m, wl, lay, feats) + _recurrent(m, wl, lay, feats)
    if lay.sp > 1:
        model_calls = 1 + int(wl.stage == "dpo")
        tokens = wl.rows * (wl.seq_len // lay.sp)
        out.append(Collective("plan", "all_gather", "sp", model_calls, model_calls * 8 * tokens))
    out += _gradients(m, wl, lay, feats)
    out += _bookkeeping(wl, lay)
    return out
