"""What the SP forwards of the newer recurrent kinds (planner.recurrent_kinds) keep for backward, per local token.

Counted from seqpar's SP forwards (seqpar.hf.short_conv / mamba1 / kda / lightning) on transformers' torch paths,
storage by storage (saved-tensor inventories), and checked against torch's MemTracker on one mixer's SP forward
(tests/test_planner_families.py: ring 1 and ring 2, two shapes each). e: the model's bytes per element; the
recurrences compute in fp32. Under a ring every piece is counted as continuing a document (the busiest rank's).

- short_conv (h channels): in_proj's output (B | C | x: e 3h, kept by B * x and C * conv), B * x (the conv's input),
  the conv's output (kept by C * conv), out_proj's input: 6 e h. Under a ring a segment with a halo runs its conv on
  a copy (halo + x) and lets B * x go, but the rank holding position 0 keeps both for its other segment: + e h / 2.
- mamba1 (d channels, state n, dt rank r): the torch scan's discretised A and B and every step's state, fp32
  [d, n] each (12 d n); nine [d] tensors in e (x | z after the exchange (2), the conv's output and its SiLU, dt + bias
  and its softplus, the scan + D, silu(z), out_proj's input), x_proj's output (dt | B | C) per head-space token
  (Ulysses: the whole of it on every rank); Jamba's RMSNorms on dt, B, C (an fp32 rsqrt and normalised copy, the
  output: 4 + 8 dim fp32 each). Per piece: the zero initial state and two more [d, n] fp32, the conv's K-1 padding
  (e d). A continuing piece (selective_piece's correction) adds exp(cumulative decay) and the einsum's product
  (two [d, n] fp32) and five fp32 [d]; per call two [d, n] states and the halo's conv padding again.
- kda (H heads, dk = dv = d, chunk C = 64, per chunk-padded head token, fp32): the per-channel decay mask, k_beta k
  products and each chunk's q k products ([C, d] each, 3 C d), the UT loop's row / block clones
  ((C-1)(2C-1)/6 + (C-1)/2), two [C] (the chunk's attention matrices), 25 [d] (inputs in fp32, l2norms, k_beta,
  v_beta, decays, per-chunk products) and five scalars; per token e H d for o_proj's input and 2 e d for the gate's
  low-rank projection. A continuing piece runs dk more value columns: + 6 d per head token (measured).
- lightning (H heads of d, blocks of B): per head token fp32, the intra-block q k^T and its decayed copy (2 B), the
  block's decay columns (2), the decayed k and the q blocks (2 d), each block's state (d^2 / B); per token in e,
  qkv_proj's output and its SiLU (6 H d), the output, the norm's input and output, the gate (4 H d), out_proj's
  input (H d) and the norm's rsqrt. A continuing piece keeps lambda^(t+1) q_t and its decay column (d + 1 fp32 per
  head token).
- rglru (W = lru_width channels, conv kernel K; measured at W 32 and 64, fp32 and bf16): fourteen [W] tensors in e
  (linear_y's output and its GELU, the conv's input and output, each gate's block-diagonal input copy and its
  sigmoid, the scaled log decay, a^2, sqrt's input, the multiplier, x * input gate, the scan's decay, the
  recurrence's output, linear_out's input) and two fp32 (the scan's state at every step, the decay it multiplies);
  per token the reset flag the exchange carries (e per Ulysses rank) and three bool masks. Per piece: the conv's
  K-1 padded outputs (e W) and the scan's zero state (fp32 W). A continuing piece keeps the cumulative log decay
  (fp32 W per token) and three fp32 [W] per piece (its decay, the incoming state, the correction's factor).
"""

from __future__ import annotations

import math

from .recurrent import RecurrentFacts

__all__ = ["new_saved_bytes", "new_backward_bytes", "new_forward_temp"]


def _padded(lengths: list[int], chunk: int) -> float:
    return sum(-(-n // chunk) * chunk for n in lengths) / sum(lengths)


def new_saved_bytes(f: RecurrentFacts, e: int, u: int, pieces: list[int], rows: int) -> int:
    """Bytes the mixer keeps for backward per local token (module docstring); `pieces`: the lengths of the pieces
    one ring rank's recurrence runs (head space), `rows` rows."""
    carry = len(pieces) > 1
    local = rows * sum(pieces) / u  # local tokens
    calls = len(pieces) * rows / local  # pieces (calls) per local token, over all rows
    if f.kind == "short_conv":
        return math.ceil(6 * e * f.heads + (e * f.heads / 2 if carry else 0))
    if f.kind == "mamba1":
        d, n, r = f.heads, f.k_dim, f.extra
        dims = (r, n, n)
        norms = sum(4 + 8 * x + (e * x if e != 4 else 0) for x in dims) if f.norms else 0
        per = 12 * d * n + e * 9 * d + u * (e * (r + 2 * n) + norms)
        per_call = 12 * d * n + e * (f.conv_kernel - 1) * d  # (/ u below: a head-space piece has d / u channels)
        if carry:
            per += 4 * (2 * d * n + 5 * d)
            per_call += 8 * d * n + e * (f.conv_kernel - 1) * d
        return math.ceil(per + calls * per_call / u)
    h, d = f.heads, f.k_dim
    if f.kind == "rglru":
        w = h * d
        per = (14 * e + 8) * w + (e + 3) * u + (4 * w if carry else 0)
        per_call = (e * (f.conv_kernel - 1) + 4 + (12 if carry else 0)) * w
        return math.ceil(per + calls * per_call / u)
    if f.kind == "kda":
        c = f.chunk
        head = 3 * c * d + (c - 1) * (2 * c - 1) / 6 + (c - 1) / 2 + 2 * c + 25 * d + 5 + (6 * d if carry else 0)
        return math.ceil(4 * h * _padded(pieces, c) * head + e * (h * d + 2 * d))
    b = f.chunk  # lightning
    head = 2 * b + 2 + 2 * d + d * d / b + ((d + 1) if carry else 0)
    return math.ceil(4 * h * head + e * 11 * h * d + 4)


def new_backward_bytes(f: RecurrentFacts, e: int, pieces: list[int], hidden: int = 0) -> int:
    """The mixer backward's peak over its saved tensors per local token, measured with MemTracker on one mixer's SP
    backward (fp32, ring 1 and 2; the recurrence runs piece by piece, so the largest piece's share): the torch scan's
    gradient buffers of its [d, n] per-step tensors (four per token in one piece; two in a continuing piece, whose
    gradients reach the scan through the correction), KDA's gradients of its [C, dk] products (2.75 per head token),
    and for the short conv and lightning attention a few e-sized [channels] gradients (2.25 h; 2.5 H d); the RG-LRU's
    gradients of its [W] tensors (3.125 e W, 2.25 e W for continuing pieces) less linear_out's freed input gradient
    (e h: measured at hidden 32, W 32 and 64)."""
    share = max(pieces) / sum(pieces)
    h, d = f.heads, f.k_dim
    if f.kind == "rglru":
        return max(0, math.ceil(e * h * d * (3.125 if len(pieces) == 1 else 2.25) - e * hidden))
    if f.kind == "short_conv":
        return math.ceil(9 * e * h / 4)
    if f.kind == "mamba1":
        return math.ceil(share * 4 * h * d * (4 if len(pieces) == 1 else 2))
    if f.kind == "kda":
        return math.ceil(share * 11 * h * f.chunk * d)
    return math.ceil(5 * e * h * d / 2)


def new_forward_temp(f: RecurrentFacts, pieces: list[int], e: int = 4, hidden: int = 0) -> int:
    """The mixer forward's peak over what it keeps, per local token (a checkpointed layer's recompute), measured as
    new_backward_bytes: mamba1's freed [d, n] temporaries (up to 1.5 fp32 per token, a continuing piece's
    cumulative decay included), KDA's (up to 0.65 fp32 [C, dk] per head token), the RG-LRU's [W] temporaries
    ((e + 4) W, e W / 2 more for continuing pieces, less e h as its backward); none for the others."""
    if f.kind == "mamba1":
        return 6 * f.heads * f.k_dim
    if f.kind == "kda":
        return math.ceil(2.6 * f.heads * f.chunk * f.k_dim)
    if f.kind == "rglru":
        return max(0, math.ceil((e + 4 + (e / 2 if len(pieces) > 1 else 0)) * f.heads * f.k_dim - e * hidden))
    return 0
