"""Step-time model: matmul and attention FLOPs, memory-bound streaming, and the communication left exposed.

Assumptions (stated in docs/planner.md; absolute GPU times are a model, the ORDERING is what
`seqpar plan --validate-time` checks against measured CPU runs on a measured CPU "cluster"):
- matmuls run at MFU (default 0.45) of the peak (bf16 peak, or the fp32 peak for fp32); attention at
  `Cluster.attention_tflops(S)` when known (measured per length on a CPU), else at the matmul rate;
- linear layers per token: 2 FLOPs per weight per forward pass (the policy's, its recomputation under
  activation checkpointing, DPO's reference pass), 2 for the input gradient, 2 more for a trained
  weight's gradient (LoRA: frozen weights skip it); tiled MLP recomputes the MLP forward;
- attention: 4 d FLOPs (q k^T and p v) per visible (query, key) pair of the busiest ring rank under each layer's
  span (planner.spans: causal, sliding window, chunk; for full attention the count of the ring's own piece plan,
  seqpar.attention.costs.flops_per_rank), forward x1 per forward pass, backward x2.5 (flash backward recomputes
  the scores); d the q / k head dim (MLA's v is padded to it for the kernel);
- memory-bound work streams at `Cluster.mem_bw`: each layer's saved activations are written once per
  forward pass and read + their gradients written in backward (3 + recomputations), AdamW reads and
  writes 28 bytes per trained parameter (its shard under FSDP); the cross-entropy streams 16 bytes per
  fp32 logit, or costs `Cluster.loss_elem_s` per logit where measured (CPU: exp/log bound);
- communication: planner.collectives lists every collective of the step (calls and bytes); each costs
  calls x latency + bytes / bandwidth (`Cluster.collective_s`). With `Cluster.overlap` (GPUs: separate
  streams) Ulysses all-to-alls and book-keeping are exposed, ring K/V hops hide behind the attention of
  the previous block (only the excess is exposed), FSDP all-gathers / reduce-scatters behind the layers'
  compute, the gradient all-reduces behind backward (seqpar.loss.OverlappedGradSum; not with bf16's fp32
  master weights, whose gradients exist only after backward: there they are exposed). Without overlap
  (CPU / gloo: the same cores compute and communicate) everything is exposed. FSDP2 adds
  `Cluster.fsdp_param_s` per parameter tensor per step;
- offload (`offload_s`): host copies over `Cluster.host_bw` overlap compute (the excess is exposed), the
  CPU optimizer step of FSDP2 CPU offload is exposed;
- host overhead: `Cluster.host_layer_s` per decoder layer and pass (0 on GPUs: kernels are enqueued
  ahead of the device, a model assumption; measured on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..attention.costs import ring_theory, ulysses_theory
from .collectives import heads_per_rank, passes, sent_ulysses_heads, step_collectives
from .gpus import Cluster
from .memory import Features, Layout, Workload, layer_bytes_per_token
from .model import ModelFacts
from .spans import FULL, Span, span_pairs_per_rank

__all__ = ["TimeEstimate", "estimate_time", "offload_s", "comm_bytes_per_layer", "attention_flops", "step_flops",
           "recurrent_flops", "DEFAULT_MFU", "attention_passes", "matmul_rate", "adamw_s", "ADAMW_BYTES_PER_PARAM",
           "param_tensors", "BACKWARD_SHARE", "attention_by_span"]

DEFAULT_MFU = 0.45
BACKWARD_SHARE = 2 / 3  # of a step's compute: backward's 2 matmuls per forward one, which gradient sums can hide behind
ADAMW_BYTES_PER_PARAM = 28  # fp32 param, grad, exp_avg, exp_avg_sq read; param, exp_avg, exp_avg_sq written


@dataclass
class TimeEstimate:
    compute_s: float  # FLOPs at the achieved rate + memory-bound streaming + host overhead
    exposed_comm_s: float  # communication not hidden behind compute, latency included (+ FSDP per-unit cost)
    comm_bytes_per_layer: int
    flops: float
    parts: dict[str, float] = field(default_factory=dict)  # seconds: matmul, attention, memory, each comm

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


def attention_flops(m: ModelFacts, wl: Workload, lay: Layout, span: Span = FULL) -> float:
    """Forward attention FLOPs of the busiest rank for one layer of this span (zigzag ring: the pairs each ring rank's
    queries see of every rank's keys; the ring skips the steps a window leaves out of reach)."""
    hq, _ = heads_per_rank(m, lay.ulysses)
    layout = "zigzag" if lay.ring > 1 else "contiguous"
    pairs = max(span_pairs_per_rank(wl.seq_len, lay.ring, layout, span))
    return 4.0 * wl.rows * hq * m.head_dim * pairs / lay.ulysses  # each ulysses rank holds 1/u of the (padded) heads


def attention_by_span(m: ModelFacts, wl: Workload, lay: Layout) -> dict[Span, tuple[int, float]]:
    """Per span: (attention layers, forward FLOPs of one such layer on the busiest rank)."""
    return {s: (n, attention_flops(m, wl, lay, s)) for s, n in m.attention_spans().items()}


def recurrent_flops(m: ModelFacts, wl: Workload, lay: Layout) -> float:
    """Forward FLOPs of one recurrent layer's conv + recurrence on one rank (hybrids; 0 otherwise). Under a ring a
    continuing Gated DeltaNet piece carries dk more value columns (seqpar.recurrent.delta)."""
    rec = m.recurrent
    if rec is None:
        return 0.0
    per_token = rec.flops_per_token()
    if lay.ring > 1 and rec.kind in ("gated_deltanet", "kda"):
        per_token = per_token * (rec.v_dim + rec.k_dim) / rec.v_dim
    return wl.rows * wl.seq_len / lay.sp * per_token


def comm_bytes_per_layer(m: ModelFacts, wl: Workload, lay: Layout) -> dict[str, int]:
    """Bytes one rank sends per decoder layer for one forward + backward, from seqpar.attention.costs."""
    hq, hkv = sent_ulysses_heads(m, lay)  # the ring (USP) moves the kv heads the exchange placed
    e, s, b = wl.elt, wl.seq_len, wl.rows
    uly = 2 * ulysses_theory(s // lay.ring, b, hq, hkv, m.head_dim, lay.ulysses, e)
    ring = ring_theory(s, b, hkv, m.head_dim, lay.ring, e) if lay.ring > 1 else {"fwd": 0, "bwd": 0}
    return {"ulysses": uly, "ring": (ring["fwd"] + ring["bwd"]) // lay.ulysses}


def step_flops(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> tuple[float, float]:
    """(linear-layer FLOPs, attention FLOPs) of one step on the busiest rank."""
    tokens = wl.rows * wl.seq_len / lay.sp
    mlp_w = 3 * m.hidden * m.intermediate
    linear_w = m.layers * m.active_layer_params() + m.hidden * m.vocab  # decoder + lm_head (MoE: top-k experts)
    trained_w = linear_w if not wl.lora else m.lora_params(wl.lora_r, wl.lora_targets)
    fwd_bwd, fwd_only = passes(wl, feats)
    linear = 2 * tokens * (linear_w * (fwd_bwd + fwd_only) + linear_w + trained_w)
    if feats.tiled_layer:  # every tiled piece runs again, with autograd, in backward
        linear += 2 * tokens * m.layers * (m.layer_params() - 2 * m.hidden)
    elif feats.tiled_mlp and not feats.activation_checkpointing:
        linear += 2 * tokens * mlp_w * m.layers  # the MLP tiles run again in backward
    attn = sum(n * f for n, f in attention_by_span(m, wl, lay).values())
    a_fwd = attn + recurrent_flops(m, wl, lay) * m.linear_layers
    return linear, a_fwd * attention_passes(wl, feats)


def attention_passes(wl: Workload, feats: Features) -> float:
    """Attention's work per step in forward-pass units: each forward pass (the policy's, its recomputation
    unless keep_attention reuses its outputs, DPO's reference pass) and the backward at 2.5x."""
    fwd_bwd, fwd_only = passes(wl, feats)
    kept = int(feats.keep_attention and feats.activation_checkpointing)  # the recompute reuses attention's outputs
    return fwd_bwd - kept + fwd_only + 2.5


def _memory_bytes(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> float:
    tokens = wl.rows * wl.seq_len / lay.sp
    fwd_bwd, fwd_only = passes(wl, feats)
    per_layer = layer_bytes_per_token(m, wl, lay.ulysses, feats.tiled_mlp, lay.ring)
    acts = tokens * m.layers * per_layer * (fwd_bwd + fwd_only + 2)
    return acts + _adamw_bytes(m, wl, lay, feats)


def _adamw_bytes(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> float:
    """AdamW's streaming per step on the device (its shard under FSDP; 0 when the update runs on the host)."""
    trained = m.num_params() if not wl.lora else m.lora_params(wl.lora_r, wl.lora_targets)
    shards = lay.world if feats.fsdp else 1
    on_device = not (feats.fsdp and feats.offload_optimizer)  # else the update runs on the host (offload_s)
    return ADAMW_BYTES_PER_PARAM * trained / shards if on_device else 0


def adamw_s(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, cl: Cluster) -> float:
    """Seconds of the optimizer's memory streaming: once per step, whatever its micro-batches."""
    return _adamw_bytes(m, wl, lay, feats) / (cl.mem_bw * 1e9)


def matmul_rate(wl: Workload, cl: Cluster, mfu: float = DEFAULT_MFU) -> float:
    """Achieved matmul FLOP/s: the precision's peak x MFU."""
    return (cl.peak_tflops if wl.precision == "bf16" else cl.fp32_tflops) * 1e12 * mfu


def offload_s(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, cl: Cluster) -> dict[str, float]:
    """Seconds of host traffic: activation offload copies every layer input to the host in forward and back
    in backward (2 L e h bytes per local token over `host_bw`, on a side stream: it overlaps compute);
    FSDP2 CPU offload copies the fp32 shards to the device for each all-gather (forward and backward) and
    the gradient shards back (3 x 4 bytes per parameter / world, overlapped with the layers' compute), and
    runs AdamW on the host (28 bytes per parameter / world at the node's host memory bandwidth shared by its
    ranks; serial: the step waits for it)."""
    out: dict[str, float] = {}
    tokens = wl.rows * wl.seq_len / lay.sp
    if feats.offload_activations:
        out["offload_acts"] = 2 * m.layers * wl.elt * m.hidden * tokens / (cl.host_bw * 1e9)
    if feats.fsdp and feats.offload_optimizer:
        n = m.num_params() if not wl.lora else m.lora_params(wl.lora_r, wl.lora_targets)
        out["offload_params"] = 3 * 4 * m.num_params() / lay.world / (cl.host_bw * 1e9)
        ranks = min(cl.gpus_per_node, lay.world)
        out["host_adamw"] = ADAMW_BYTES_PER_PARAM * n / lay.world / (cl.host_mem_bw * 1e9 / ranks)
    return out


def _loss_s(m: ModelFacts, wl: Workload, lay: Layout, cl: Cluster) -> float:
    """Cross-entropy over the vocabulary: forward + backward for the policy, a forward (a third) for DPO's
    reference; 16 fp32 bytes per logit at mem_bw unless the cluster measured its rate."""
    logits = wl.rows * wl.seq_len / lay.sp * m.vocab * (1 + (1 / 3 if wl.stage == "dpo" else 0))
    return logits * (cl.loss_elem_s if cl.loss_elem_s is not None else 16 / (cl.mem_bw * 1e9))


def param_tensors(m: ModelFacts) -> int:
    """Parameter tensors (FSDP2's per-tensor costs): 7 projections + 2 norms a layer (+ q/k norms, q/k/v
    biases), the embedding, the final norm and an untied head."""
    if m.blocks or m.family is not None:  # a block decoder / planner.families: each layer's tensors
        return len(m.decoder_tensors()) + 2 + (0 if m.tied else 1)
    per_layer = 9 + (2 if m.qk_norm else 0) + (3 if m.qkv_bias else 0)
    rec = len(m.recurrent.mixer_tensors(m.hidden)) + 5 if m.recurrent is not None else 0  # + MLP and norms
    return m.attn_layers * per_layer + m.linear_layers * rec + 2 + (0 if m.tied else 1)


def _group(lay: Layout, group: str) -> tuple[int, int]:
    """(size, stride) of a group: ulysses innermost, then ring, then dp (ranks fill nodes in order)."""
    return {"ulysses": (lay.ulysses, 1), "ring": (lay.ring, lay.ulysses), "sp": (lay.sp, 1),
            "dp": (lay.dp, lay.sp), "world": (lay.world, 1)}[group]


def estimate_time(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, cl: Cluster,
                  mfu: float = DEFAULT_MFU) -> TimeEstimate:
    rate = matmul_rate(wl, cl, mfu)
    # Rate of one causal kernel over the full length, under ring too: its pieces are shorter, but all but
    # the diagonal ones are unmasked (no wasted blocks); measured CPU step times show the two balance.
    kernel_tflops = cl.attention_tflops(wl.seq_len)
    attn_rate = kernel_tflops * 1e12 if kernel_tflops else rate
    linear, attn = step_flops(m, wl, lay, feats)
    parts = {"matmul": linear / rate, "attention": attn / attn_rate,
             "memory": _memory_bytes(m, wl, lay, feats) / (cl.mem_bw * 1e9), "loss": _loss_s(m, wl, lay, cl),
             "host": m.layers * (sum(passes(wl, feats)) + 1) * cl.host_layer_s}
    compute = sum(parts.values())
    comm: dict[str, float] = {}
    for c in step_collectives(m, wl, lay, feats):
        comm[c.what] = comm.get(c.what, 0.0) + cl.collective_s(c.kind, c.calls, c.nbytes, *_group(lay, c.group))
    exposed = dict(comm)
    if cl.overlap:
        if "ring" in exposed:
            exposed["ring"] = max(0.0, comm["ring"] - parts["attention"])
        fsdp = comm.get("fsdp_gather", 0.0) + comm.get("fsdp_reduce", 0.0)
        exposed.pop("fsdp_gather", None)
        exposed.pop("fsdp_reduce", None)
        if fsdp:
            exposed["fsdp"] = max(0.0, fsdp - compute)
        if "grads" in exposed and not (wl.precision == "bf16" and not feats.fsdp):
            exposed["grads"] = max(0.0, comm["grads"] - compute * BACKWARD_SHARE)
    if feats.fsdp and lay.world > 1:
        exposed["fsdp_params"] = param_tensors(m) * cl.fsdp_param_s
    host = offload_s(m, wl, lay, feats, cl)
    if "host_adamw" in host:
        exposed["host_adamw"] = host.pop("host_adamw")
    for k, v in host.items():  # side-stream copies: only what compute cannot cover is exposed
        exposed[k] = max(0.0, v - compute) if cl.overlap else v
    parts.update({f"comm_{k}": v for k, v in exposed.items()})
    cb = comm_bytes_per_layer(m, wl, lay)
    return TimeEstimate(compute, sum(exposed.values()), cb["ulysses"] + cb["ring"], linear + attn, parts)
