"""A hybrid's recurrent mixer in the planner's memory model: what it keeps for backward and what its backward adds.

Counted tensor by tensor from transformers' torch paths (the ones seqpar runs on CPU, and on GPU without
flash-linear-attention / mamba_ssm): Qwen3.5 / Qwen3-Next's `torch_chunk_gated_delta_rule` and the Mamba2
mixers' `mamba2_chunk_scan` (Bamba, Granite 4, Nemotron-H), each inside its layer (projections, causal conv,
gated RMSNorm, out_proj), as seqpar.hf.linear_attention / seqpar.hf.mamba2 call them. Checked storage by storage
against torch's MemTracker on the tiny models (`seqpar plan --validate --hybrid`, docs/planner.md).

Per local token (e: the model's bytes per element; the recurrences compute in fp32), with H v heads (Mamba2:
heads), chunk C, head dims dk / dv (Mamba2: state n, head dim p), w = H dv (H p) the recurrence's output width:

- Gated DeltaNet, on every chunk-padded token of each v head, fp32: five [C] tensors (the pairwise decays, the UT
  system k_beta k^T and its masked product, q k^T and the intra-chunk attention), twelve [dk] (q and k before the
  l2norm, the padded key and query, the matmuls' contiguous copies, k_beta, k_cumdecay, the decayed q and k),
  three [dv] (value, new_values, v_new; one more when no k head is repeated), six scalars (the l2norms' rsqrt,
  beta, three decays) and each chunk's state [dk, dv]; once per call the chunk's bool mask (C^2 bytes).
  Outside it: the conv's input and its SiLU's input (e per conv channel each), beta (e H) and the decay's
  softplus input and output (4 H each), the gated norm (four fp32 [w] tensors, its rsqrt 4 H, the gate and
  out_proj's input: e w each).
- Mamba2, on every padded token of each head, fp32: three [C] (exp(segment_sum), G, the M copy), five [n] (the
  B / C copies the einsums keep, B chunked, B_decay), four [p] (x for D, x chunked, its copy, C_times_states),
  three scalars (dt, decay_states, state_decay_out), two states per chunk [p, n]; once per call the chunks'
  decay matrix [(chunks + 1)^2] per head. Outside: in_proj's whole output (its gate and conv parts are views
  of it; e (w + conv channels + H)), the conv's SiLU input and output (e per channel each), dt's softplus and
  clamp inputs (e H each), the gated norm (four fp32 [w], rsqrt per group, out_proj's input e w).
- Under a ring every piece but the sequence's first continues a document (seqpar.recurrent): Gated DeltaNet
  runs dk more value columns (its output with them is kept for the correction), Mamba2 keeps C per head in
  fp32, the step and its cumulative decay (4 (n + 4) per head).

The backward (`mixer_backward_bytes`): the peak of the mixer's backward over its saved tensors, per local token:
- Gated DeltaNet: the chunked rule's backward holds three [C], three [dk] and two [dv] fp32 gradients per
  padded head token beside its saved tensors, while the gated norm's (five [w] and its rsqrt) are gone;
- Mamba2: the intra-chunk block's backward holds the gradients of M and G (two [C]) per padded head token,
  while the state path's copies (p and n terms) are already freed (measured: 9 p + 4.5 n bytes per head token
  at C 16..128, p 4..16, n 8..32) and the norm's three [w]; at least the gradient of in_proj's output.
"""

from __future__ import annotations

import math

from .recurrent import RecurrentFacts
from .recurrent_kinds_memory import new_backward_bytes, new_forward_temp, new_saved_bytes

__all__ = ["mixer_saved_bytes", "mixer_backward_bytes", "mixer_forward_temp", "piece_lengths"]


def piece_lengths(seq_len: int, ring: int) -> list[int]:
    """The pieces one ring rank's recurrence runs (head space: Ulysses gathers its ring rank's sequence): the whole
    sequence without a ring, else the zigzag's two segments."""
    return [seq_len] if ring == 1 else [max(1, seq_len // (2 * ring))] * 2


def _padded(lengths: list[int], chunk: int) -> float:
    """Chunk-padded tokens over tokens (each piece is padded to a multiple of the chunk)."""
    return sum(-(-n // chunk) * chunk for n in lengths) / sum(lengths)


def mixer_saved_bytes(f: RecurrentFacts, e: int, u: int, ring: int, seq_len: int, rows: int) -> int:
    """Bytes one recurrent mixer keeps for backward per local token (module docstring); per-call terms spread
    over the local tokens of `rows` rows."""
    pieces = piece_lengths(seq_len, ring)
    if f.new:  # short conv, Mamba1, KDA, lightning attention
        return new_saved_bytes(f, e, u, pieces, rows)
    pad, carry = _padded(pieces, f.chunk), ring > 1
    h, w, c = f.v_heads, f.value_width, f.conv_channels
    local = rows * sum(pieces) / u  # local tokens (the head-space pieces hold u times as many, of H / u heads)
    if f.kind == "gated_deltanet":
        kd, vd, C = f.k_dim, f.v_dim + (f.k_dim if carry else 0), f.chunk
        dv_terms = 3 if f.v_heads != f.heads else 4  # one more [dv] copy without repeated k heads (measured)
        # the chunked matmuls copy their [dk] operands only when a piece has several chunks (one: views)
        dk_terms = 12 if max(pieces) > C else 7
        rule = 4 * (5 * C + dk_terms * kd + dv_terms * vd + 6) + 4 * kd * vd / C
        outside = 2 * e * c + e * h + 8 * h + 16 * w + 2 * e * w + 4 * h
        kept_out = e * h * vd if carry else 0  # the augmented output the correction's rows view
        per_call = len(pieces) * C * C / local  # the chunk mask (bool) of each call
        return math.ceil(h * pad * rule + outside + kept_out + per_call)
    p, n, C = f.v_dim, f.k_dim, f.chunk
    scan = 4 * (4 * p + 3 * C + 5 * n + 3) + 8 * p * n / C
    chunks = [-(-x // C) for x in pieces]
    decay = sum(4 * h // u * (k + 1) ** 2 for k in chunks) * rows / local  # the decay matrix per head and row
    outside = e * (w + c + h) + 2 * e * c + 2 * e * h + 16 * w + 4 * f.groups + e * w
    extra = 4 * (n + 4) * h if carry else 0
    return math.ceil(h * pad * scan + decay + outside + extra)


def mixer_backward_bytes(f: RecurrentFacts, e: int, ring: int, seq_len: int, hidden: int = 0) -> int:
    """The mixer backward's peak over its saved tensors, per local token (module docstring). The recurrence runs
    piece by piece (a ring rank's two segments), so its backward's gradients are one piece's at a time."""
    pieces = piece_lengths(seq_len, ring)
    if f.new:
        return new_backward_bytes(f, e, pieces, hidden)
    pad, carry = _padded(pieces, f.chunk), ring > 1
    share = pad * max(pieces) / sum(pieces)  # the largest piece's padded tokens over the rank's tokens
    h, w, C = f.v_heads, f.value_width, f.chunk
    if f.kind == "gated_deltanet":
        vd = f.v_dim + (f.k_dim if carry else 0)
        return max(0, math.ceil(4 * h * share * (3 * C + 3 * f.k_dim + 2 * vd) - 20 * w - 4 * h))
    scan = h * share * (8 * C - 9 * f.v_dim - 4.5 * f.k_dim) - 12 * w - 8 * f.groups
    return math.ceil(max(scan, e * (w + f.conv_channels + h)))


def mixer_forward_temp(f: RecurrentFacts, ring: int, seq_len: int, e: int = 4, hidden: int = 0) -> int:
    """The mixer forward's peak over what it keeps, per local token: a checkpointed layer's recompute runs it at the
    start of the layer's backward. Measured on the torch paths (one piece at a time): Gated DeltaNet's fp32 [dk]
    and [dv] temporaries beside the chunk loop (4 H (dk + dv + 3)), Mamba2's B / C einsum copies (H (9 n + 1.75 p))."""
    pieces = piece_lengths(seq_len, ring)
    if f.new:
        return new_forward_temp(f, pieces, e, hidden)
    share = _padded(pieces, f.chunk) * max(pieces) / sum(pieces)
    h = f.v_heads
    if f.kind == "gated_deltanet":
        vd = f.v_dim + (f.k_dim if ring > 1 else 0)
        return math.ceil(4 * h * share * (f.k_dim + vd + 3))
    return math.ceil(h * share * (9 * f.k_dim + 1.75 * f.v_dim))
