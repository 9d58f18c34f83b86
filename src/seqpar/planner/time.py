"""Step-time model: matmul FLOPs at an assumed efficiency, plus the communication left exposed.

Assumptions (stated in docs/planner.md; absolute GPU times are a model, the ORDERING is what
`seqpar plan --validate-time` checks against measured runs):
- matmuls run at MFU (default 0.45) of the peak (bf16 peak, or the fp32 peak for fp32);
- linear layers: 2 FLOPs per weight per token forward, 4 backward (x3 total); activation
  checkpointing recomputes the forward once more (x4); tiled MLP recomputes the MLP (x4 on the MLP);
- attention: the causal FLOPs of the ring's own piece plan (bench.theory.flops_per_rank, the
  busiest ring rank), forward x1, backward x2.5 (flash backward recomputes the scores);
- bytes per rank from bench.theory (ulysses_theory / ring_theory) with the head plan's padded heads;
  ulysses all-to-alls are exposed; ring K/V hops overlap the attention of the previous block, so only
  what exceeds it is exposed; FSDP all-gathers / reduce-scatters overlap the layer compute; the dp
  gradient all-reduce (no FSDP) is exposed. A link's bandwidth is the intra-node one while the
  group fits in a node (ulysses innermost, then ring), else the inter-node one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.ulysses import head_plan
from ..bench.theory import flops_per_rank, ring_theory, ulysses_theory
from .gpus import Cluster
from .memory import Features, Layout, Workload
from .model import ModelFacts

__all__ = ["TimeEstimate", "estimate_time", "comm_bytes_per_layer", "attention_flops", "DEFAULT_MFU"]

DEFAULT_MFU = 0.45


@dataclass
class TimeEstimate:
    compute_s: float
    exposed_comm_s: float
    comm_bytes_per_layer: int
    flops: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s


def _heads_per_rank(m: ModelFacts, u: int) -> tuple[int, int]:
    if u == 1:
        return m.heads, m.kv_heads
    plan = head_plan(m.heads, m.kv_heads, u)
    return plan.padded_heads, plan.expanded_kv_heads


def attention_flops(m: ModelFacts, wl: Workload, lay: Layout) -> float:
    """Forward causal attention FLOPs of the busiest rank for one layer (ring piece plan, zigzag)."""
    hq, _ = _heads_per_rank(m, lay.ulysses)
    layout = "zigzag" if lay.ring > 1 else "contiguous"
    per_ring_rank = max(flops_per_rank(wl.seq_len, lay.ring, layout, hq, m.head_dim, wl.rows))
    return per_ring_rank / lay.ulysses  # each ulysses rank holds 1/u of the (padded) heads


def comm_bytes_per_layer(m: ModelFacts, wl: Workload, lay: Layout) -> dict[str, int]:
    """Bytes one rank sends per decoder layer (forward + backward), from bench.theory."""
    hq, hkv = _heads_per_rank(m, lay.ulysses)
    e, s, b = wl.elt, wl.seq_len, wl.rows
    uly = 2 * ulysses_theory(s // lay.ring, b, hq, hkv, m.head_dim, lay.ulysses, e) if lay.ulysses > 1 else 0
    ring = ring_theory(s, b, hkv, m.head_dim, lay.ring, e) if lay.ring > 1 else {"fwd": 0, "bwd": 0}
    return {"ulysses": uly, "ring": (ring["fwd"] + ring["bwd"]) // lay.ulysses}


def estimate_time(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, cl: Cluster,
                  mfu: float = DEFAULT_MFU) -> TimeEstimate:
    tokens = wl.rows * wl.seq_len / lay.sp
    peak = (cl.peak_tflops if wl.precision == "bf16" else cl.fp32_tflops) * 1e12 * mfu
    mlp_w = 3 * m.hidden * m.intermediate
    attn_w = m.layer_params() - mlp_w
    fwd = 2 * tokens * (attn_w + mlp_w) * m.layers + 2 * tokens * m.hidden * m.vocab
    redo = (2 * tokens * (attn_w + mlp_w) if feats.activation_checkpointing
            else 2 * tokens * mlp_w if feats.tiled_mlp else 0) * m.layers
    a_fwd = attention_flops(m, wl, lay) * m.layers
    flops = 3 * fwd + redo + a_fwd * (1 + 2.5 + (1 if feats.activation_checkpointing else 0))
    compute = flops / peak
    cb = comm_bytes_per_layer(m, wl, lay)
    uly_bw = cl.bw(lay.ulysses) * 1e9
    ring_bw = cl.bw(lay.ring, lay.ulysses) * 1e9
    uly_s = cb["ulysses"] * m.layers / uly_bw
    attn_s = a_fwd * 3.5 / peak
    ring_s = max(0.0, cb["ring"] * m.layers / ring_bw - attn_s)
    n = m.num_params() if not wl.lora else m.lora_params(wl.lora_r, wl.lora_targets)
    w = lay.world
    if feats.fsdp:
        fsdp_bytes = 3 * m.num_params() * e_bytes(wl) * (w - 1) / w
        grad_s = max(0.0, fsdp_bytes / (cl.bw(w) * 1e9) - compute)
    else:
        grad_s = 2 * n * e_bytes(wl) * (w - 1) / w / (cl.bw(w) * 1e9) if w > 1 else 0.0
    return TimeEstimate(compute, uly_s + ring_s + grad_s, cb["ulysses"] + cb["ring"], flops)


def e_bytes(wl: Workload) -> int:
    return wl.elt
