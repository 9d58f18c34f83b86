"""Bytes one decoder layer keeps for backward, per local token, tensor by tensor (see planner.memory's module
docstring for the list), and what stays alive at the end of forward."""

from __future__ import annotations

import math

from ..attention.ulysses import head_plan
from .family_memory import family_layer_bytes, family_mlp_bytes
from .model import ModelFacts
from .recurrent_memory import mixer_saved_bytes
from .spans import FULL, span_rows_factor
from .tiled import layer_tiles, tiled_saved_per_token
from .workload import INDEX_BYTES_PER_TOKEN, Features, Layout, Workload

__all__ = ["norm_bytes", "attention_bytes", "lora_bytes", "mlp_bytes", "layer_bytes_per_token", "mlp_tiles",
           "kept_attention_bytes", "ring_rows_factor", "block_bytes_per_token", "rope_bytes",
           "activation_bytes_per_token"]


def norm_bytes(m: ModelFacts, e: int, input_grad: bool, weight_trains: bool, consumer_saves: bool) -> int:
    """Bytes one RMSNorm keeps per token: fp32 input + rsqrt, normalised x (weight grad), output (consumer)."""
    n = (4 * m.hidden + 4) if input_grad else 0
    return n + (e * m.hidden if weight_trains else 0) + (e * m.hidden if consumer_saves else 0)


def attention_bytes(m: ModelFacts, wl: Workload, u: int, ring: int = 1, kind: str = "mean") -> int:
    """The mixer's saved bytes per local token: softmax attention's, or for a hybrid (kind "mean") the average over
    its layers of attention's and the recurrent mixer's (planner.recurrent_memory); kind "attention" /
    "recurrent": one layer of that kind."""
    soft = _softmax_bytes(m, wl, u)
    if not m.linear_layers or m.recurrent is None or kind == "attention":
        return soft
    rec = mixer_saved_bytes(m.recurrent, wl.elt, u, ring, wl.seq_len, wl.rows)
    if kind == "recurrent":
        return rec
    return (m.attn_layers * soft + m.linear_layers * rec) // m.layers


def _softmax_bytes(m: ModelFacts, wl: Workload, u: int) -> int:
    """q, k, v, the output and lse at the kernel's widths (MLA: v and the output padded to q / k's head dim), the
    sequence-space output o_proj keeps (MLA: heads x v_head_dim, a copy of the sliced output), MLA's projections."""
    e, d = wl.elt, m.head_dim
    n = _mla_bytes(m, wl)
    if m.qk_norm:
        full = not wl.lora
        n += 4 * (m.q_dim + m.kv_dim) + 4 * (m.heads + m.kv_heads) + (e * (m.q_dim + m.kv_dim) if full else 0)
    n += e * m.q_dim if m.gated_attention else 0  # the output gate
    o_in = e * m.o_dim if wl.trains("o_proj") else 0
    if u == 1:
        return n + e * (2 * m.q_dim + 2 * m.kv_dim) + 4 * m.heads + (o_in if m.mla is not None else 0)
    plan = head_plan(m.heads, m.kv_heads, u)
    hq, hkv = plan.padded_heads, plan.expanded_kv_heads
    # per LOCAL token: the head-space q, k, v, output and lse of P tokens x 1/P of the heads
    n += e * (2 * hq + 2 * hkv) * d + 4 * hq
    return n + o_in  # the sequence-space output o_proj keeps


def _mla_bytes(m: ModelFacts, wl: Workload) -> int:
    """MLA's low-rank projections (counted from transformers' code, not metered): each RMSNorm on a latent (q_a's
    output, kv_a's compressed kv) keeps its fp32 input and rsqrt, its normalised x (a trained weight) and its output
    (the next projection's input)."""
    if m.mla is None:
        return 0
    e, full, a = wl.elt, not wl.lora, m.mla
    ranks = [a.kv_lora_rank] + ([a.q_lora_rank] if a.q_lora_rank else [])
    return sum(4 * r + 4 + (e * r if full else 0) + e * r for r in ranks)


def lora_bytes(m: ModelFacts, wl: Workload) -> int:
    return wl.elt * wl.lora_r * sum(1 for t in wl.lora_targets) if wl.lora else 0


def mlp_bytes(m: ModelFacts, wl: Workload, tiled: bool, kind: str = "mean") -> int:
    if tiled:
        return 0  # tiles are recomputed in backward: nothing [S, intermediate] stays alive
    if m.family is not None:  # planner.families: dense, MoE or no MLP, layer by layer
        return family_mlp_bytes(m, wl, kind)
    if m.moe is not None:  # planner.moe: the routed experts' and the shared expert's tensors
        return m.moe.saved_bytes(wl.elt, m.hidden)
    if m.blocks:  # Nemotron-H's relu2 MLP: relu's output (kept by relu and by square), the square (down_proj's)
        return wl.elt * m.intermediate * (1 + (1 if wl.trains("down_proj") else 0))
    return wl.elt * m.intermediate * (3 + (1 if wl.trains("down_proj") else 0))


def layer_bytes_per_token(m: ModelFacts, wl: Workload, u: int, tiled_mlp: bool = False, ring: int = 1,
                          kind: str = "mean") -> int:
    """What one decoder layer keeps for backward, per local token (no checkpointing); kind as attention_bytes'."""
    if m.blocks:
        return block_bytes_per_token(m, wl, u, ring, kind)
    if m.family is not None:  # planner.families: each layer's norms, mixers and MLP
        rec = mixer_saved_bytes(m.recurrent, wl.elt, u, ring, wl.seq_len, wl.rows) if m.recurrent else 0
        return family_layer_bytes(m, wl, u, ring, kind, _softmax_bytes(m, wl, u), rec) + lora_bytes(m, wl)
    e, full = wl.elt, not wl.lora
    qkv = any(wl.trains(t) for t in ("q_proj", "k_proj", "v_proj"))
    mlp_in = any(wl.trains(t) for t in ("gate_proj", "up_proj"))
    return (norm_bytes(m, e, True, full, qkv) + attention_bytes(m, wl, u, ring, kind)
            + norm_bytes(m, e, True, full, mlp_in or tiled_mlp) + mlp_bytes(m, wl, tiled_mlp) + lora_bytes(m, wl))


def block_bytes_per_token(m: ModelFacts, wl: Workload, u: int, ring: int = 1, kind: str = "mean") -> int:
    """What one block of a block decoder (Nemotron-H) keeps for backward, per local token: its norm and its mixer
    ("attention", "recurrent") or its MLP ("mlp"); "mean": the average over the blocks."""
    if kind == "mean":
        kinds = [m.block_kind(i) for i in range(m.layers)]
        return sum(block_bytes_per_token(m, wl, u, ring, k) for k in kinds) // m.layers
    e, full = wl.elt, not wl.lora
    if kind == "mlp":
        body, consumer = mlp_bytes(m, wl, False), any(wl.trains(t) for t in ("gate_proj", "up_proj"))
    else:
        body, consumer = attention_bytes(m, wl, u, ring, kind), any(wl.trains(t) for t in ("q_proj", "k_proj",
                                                                                          "v_proj"))
        consumer = consumer or (kind == "recurrent" and full)
    return norm_bytes(m, e, True, full, consumer) + body + lora_bytes(m, wl)


def rope_bytes(m: ModelFacts, e: int) -> int:
    """RoPE's cos / sin per token (none for attention without rotary embeddings)."""
    return 2 * e * m.head_dim if m.rope else 0


def mlp_tiles(m: ModelFacts, wl: Workload, lay: Layout) -> int:
    """memory.tiled_mlp's automatic tile count (seqpar.memory.tiled_mlp.auto_tile_count) for one row of
    this rank's shard; 1 tile runs the plain MLP (nothing is checkpointed)."""
    return layer_tiles(m, max(1, wl.seq_len // lay.sp))  # the runtime's one rule for both tiled pieces


def ring_rows_factor(ring: int) -> float:
    """How many kernel calls a query row is in over one zigzag ring pass, on the busiest rank (rows of every
    (q block, kv block) piece over the local rows) under full attention: 1 without a ring."""
    return 1.0 if ring == 1 else span_rows_factor(4 * ring, ring, FULL)


def kept_attention_bytes(m: ModelFacts, e: int, u: int, ring: int, seq_len: int = 0) -> int:
    """Bytes per local token and layer memory.keep_attention holds from a layer's forward to its recompute: every
    kernel call's out (input dtype) and lse (fp32) on the widths it ran on (Ulysses: the plan's head space). A
    windowed layer keeps none for the ring steps it skips (planner.spans; seq_len: the row's length)."""
    if u > 1:
        plan = head_plan(m.heads, m.kv_heads, u)
        wq, heads = plan.padded_heads * m.head_dim, plan.padded_heads
    else:
        wq, heads = m.q_dim, m.heads
    rows = sum(n * (ring_rows_factor(ring) if s.kind == "full" or ring == 1 or seq_len < 2 * ring
                    else span_rows_factor(seq_len, ring, s)) for s, n in m.attention_spans().items())
    # a hybrid's recurrent layers keep nothing of the kind: spread over all layers as the callers count them
    return math.ceil(rows * (e * wq + 4 * heads) / m.layers)


def activation_bytes_per_token(m: ModelFacts, wl: Workload, u: int, feats: Features, ring: int = 1) -> int:
    """Bytes alive per local token at the end of forward (loss working set excluded)."""
    e, full = wl.elt, not wl.lora
    once = rope_bytes(m, e) + INDEX_BYTES_PER_TOKEN  # RoPE cos/sin, int64 index tensors
    # the final norm (lm_head keeps its output); with the tiled layer it runs in tiles and keeps only its input
    once += e * m.hidden if feats.tiled_layer else norm_bytes(m, e, True, full, full and not feats.fused_loss)
    if feats.fused_loss:
        once += e * m.hidden  # the supervised hidden states the loss chunks keep
    if feats.activation_checkpointing:
        kept = 0 if feats.offload_activations else m.layers  # offload: every layer input is in the host store
        attn = m.layers * kept_attention_bytes(m, e, u, ring, wl.seq_len) if feats.keep_attention else 0
        return once + kept * e * m.hidden + attn  # (layer 0's input is kept even when the embedding is frozen)
    if feats.tiled_layer:
        return once + m.layers * tiled_saved_per_token(m, e, u)
    if wl.lora:
        once -= 4 * m.hidden + 4  # a frozen embedding: layer 0's norm input needs no gradient
    return once + m.layers * layer_bytes_per_token(m, wl, u, feats.tiled_mlp, ring)
