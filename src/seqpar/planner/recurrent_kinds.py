"""The recurrent / convolutional mixers of the hybrid families beyond Gated DeltaNet and Mamba2, for the planner:
the formulas of planner.recurrent.RecurrentFacts for each new `kind` (planner.family_model reads them from a config).

- short_conv (LFM2, LFM2-MoE, LFM3: seqpar.hf.short_conv): in_proj to B | C | x, a depthwise causal conv of
  conv_L_cache taps over B * x (hidden channels), C * conv, out_proj. No state: the ring sends a halo only.
- mamba1 (Jamba, Falcon-Mamba, Mamba: seqpar.hf.mamba1): d = intermediate channels, state n per channel,
  dt rank r; the ring passes one fp32 state [d, n] per hop with a "diagonal" transition of the same size.
- kda (Kimi-Linear: seqpar.hf.kda): H heads of dk = dv = linear_head_dim, conv over q | k | v, the delta rule with
  a decay per key channel; states [dk, dv] per head and a "matrix" transition [dk, dk], as Gated DeltaNet's.
- lightning (MiniMax: seqpar.hf.lightning): H heads of head_dim, blocks of block_size tokens, no conv; states
  [d, d] per head, a "scalar" transition (one decay per head).
- rglru (RecurrentGemma: seqpar.hf.rglru): W = lru_width channels in H = num_attention_heads gate blocks of
  b = W / H; linear_x -> a depthwise causal conv of conv1d_width taps -> the RG-LRU (block-diagonal input /
  recurrence gates, a diagonal recurrence per channel) -> times gelu(linear_y) -> linear_out; every projection and
  the conv with a bias. The ring passes one fp32 state [W] per hop with a "diagonal" transition of the same size;
  Ulysses splits the channels by whole gate blocks (its degree divides H).
Field use (RecurrentFacts): heads / v_heads (mamba1: channels d; short_conv: hidden; rglru: gate blocks H),
k_dim (mamba1: n; rglru: the block width b), v_dim (rglru: b),
groups, conv_kernel (lightning: 1, no conv), chunk (kda: the delta rule's 64; lightning: its block; else 1),
extra (mamba1: dt rank; lightning: unused), bias (short_conv: the projections' and conv's biases; mamba1: the
conv's), norms (mamba1's dt / B / C RMSNorms: 1 weightless, Falcon-Mamba; 2 weighted, Jamba).
"""

from __future__ import annotations

from typing import Any

__all__ = ["NEW_KINDS", "KDA_CHUNK", "conv_channels", "mixer_tensors", "flops_per_token", "ulysses_elems",
           "state_elems"]

NEW_KINDS = ("short_conv", "mamba1", "kda", "lightning", "rglru")
KDA_CHUNK = 64  # transformers' chunk_kimi_delta_attention torch path


def conv_channels(f: Any) -> int:
    if f.kind == "short_conv":
        return f.heads
    if f.kind == "mamba1":
        return f.heads
    if f.kind == "kda":
        return 3 * f.heads * f.k_dim
    if f.kind == "rglru":  # the lru_width channels x runs through
        return f.heads * f.k_dim
    return 3 * f.heads * f.k_dim  # lightning: q | k | v (no conv; what its Ulysses exchange moves)


def mixer_tensors(f: Any, h: int) -> list[int]:
    """Element counts of the mixer's parameters (what transformers 5.24 builds for each layer kind)."""
    if f.kind == "short_conv":  # in_proj, out_proj, the depthwise conv (+ their biases)
        return [3 * h * h, h * h, h * f.conv_kernel] + ([3 * h, h, h] if f.bias else [])
    if f.kind == "mamba1":  # in_proj, conv, x_proj, dt_proj (+ bias), A_log, D, out_proj (+ Jamba's norms)
        d, n, r = f.heads, f.k_dim, f.extra
        t = [h * 2 * d, d * f.conv_kernel, d * (r + 2 * n), r * d, d, d * n, d, d * h]
        return t + ([d] if f.bias else []) + ([r, n, n] if f.norms == 2 else [])
    if f.kind == "kda":  # q k v, conv, forget gate (f_a, f_b, dt_bias, A_log), b_proj, g_a, g_b, o_norm, o_proj
        hd, d = f.heads * f.k_dim, f.k_dim
        return [3 * h * hd, 3 * hd * f.conv_kernel, h * d, d * hd, hd, f.heads, h * f.heads, h * d, d * hd, d,
                hd * h]
    if f.kind == "rglru":  # linear_y, linear_x, linear_out, conv_1d (+ biases), recurrent_param, the two gates' blocks
        w, b = f.heads * f.k_dim, f.k_dim
        return [h * w, w, h * w, w, w * h, h, w * f.conv_kernel, w, w, f.heads * b * b, w, f.heads * b * b, w]
    hd = f.heads * f.k_dim  # lightning: qkv_proj, out_proj, output_gate, the norm over all heads
    return [3 * h * hd, hd * h, h * hd, hd]


def flops_per_token(f: Any) -> int:
    """Forward FLOPs of the mixer's sequence part per token (the projections are counted with the weights)."""
    k = f.conv_kernel
    if f.kind == "short_conv":  # the conv and the two gating products
        return 2 * f.heads * k + 2 * f.heads
    if f.kind == "mamba1":  # conv; per channel and state entry: exp(dt A), dt B x, the update, C . h
        return 2 * f.heads * k + 8 * f.heads * f.k_dim
    if f.kind == "kda":  # the chunked delta rule (as Gated DeltaNet's) with a decay per key channel
        c, d, hh = f.chunk, f.k_dim, f.heads
        return 2 * hh * (c * 4 * d + 4 * d * d) + 2 * hh * c * d + 2 * conv_channels(f) * k
    if f.kind == "rglru":  # conv; per channel: the gates' sigmoids, log a, exp, sqrt(1 - a^2), three products, the scan
        return 2 * f.heads * f.k_dim * (k + 5)
    c, d = f.chunk, f.k_dim  # lightning: q k^T and its product with v inside a block, q S and the state update
    return 2 * f.heads * (2 * c * d + 2 * d * d)


def ulysses_elems(f: Any, u: int) -> tuple[int, int]:
    """Elements per token the Ulysses all-to-alls move in and out (mamba1's x_proj all-reduce apart)."""
    if f.kind in ("short_conv", "lightning"):
        return conv_channels(f), f.heads * f.v_dim if f.kind == "lightning" else f.heads
    if f.kind == "mamba1":  # x and z in, the scan's output out
        return 2 * f.heads, f.heads
    if f.kind == "rglru":  # x and one reset flag per destination rank in, the RG-LRU's output out
        return f.heads * f.k_dim + u, f.heads * f.k_dim
    return 4 * f.heads * f.k_dim + f.heads, f.heads * f.v_dim  # kda: q k v g and beta in


def state_elems(f: Any, u: int) -> tuple[int, int]:
    """(elements of one state, of one transition) per row on one Ulysses rank (short_conv: no state)."""
    if f.kind == "short_conv":
        return 0, 0
    if f.kind in ("mamba1", "rglru"):  # a diagonal transition: one decay per state entry (rglru: per channel)
        return f.heads // u * f.k_dim, f.heads // u * f.k_dim
    hl = f.heads // u
    if f.kind == "kda":
        return hl * f.k_dim * f.v_dim, hl * f.k_dim * f.k_dim
    return hl * f.k_dim * f.v_dim, hl
