"""The tiled decoder layer's bytes (`memory.tiled_layer`, seqpar.memory.tiled_compute), per local token.

A tiled layer runs norms, q/k/v (+ q/k norms, RoPE) in sequence tiles before attention and o_proj, the
residual adds, the post-attention norm and the MLP in tiles after it; each tiled piece saves only its
inputs and recomputes one tile at a time in backward. What stays for backward per token: the layer input
(e h) and attention's own saved tensors (q, k, v, output, lse; with Ulysses the head-space copies and the
sequence-space output the second piece takes as input). In a layer's backward (with checkpointing: after
its recompute), the moments are
- the second piece's backward (`TiledTerms.mlp_*`): the incoming gradient e h, the full-length gradient
  buffers of the piece's inputs (attention output e q, layer input e h), one tile's recompute (fp32 norm
  input and rsqrt, normalised x and output, gate, silu(gate) and up, the tile's middle residual and its
  output, o_proj's copy of a strided tile) at the product's backward (the product itself, down_proj's
  input, is consumed: three [tile, I] gradients exist) and that piece's parameter gradients (o_proj,
  post-attention norm, MLP), summed over the tiles, plus the tile's own down_proj gradient from the second
  tile on (measured with the exact meter on 27 tiled rows, worst 1.03%);
- attention's backward (`attn_temp`, `attention_backward_temp`): the second piece's input-gradient buffers
  (layer input e h, attention output e q) and seqpar's attention backward at its largest moment, every
  tensor counted (measured with the exact meter, tiny Llama, fp32 and bf16, u = 1 and 2):
  the local attention (u = 1, ring = 1: attention.local, one kernel call): the kernel's outputs dq, dk, dv
  in the input dtype, e (q + 2 kv), beside the incoming gradient e q;
  ring path (u = 1, ring > 1): the zigzag ring's busiest step (`ring_backward_temp`, measured with ring 2):
  the accumulators dq, dk, dv in fp32 and the kernel's outputs of one piece;
  fused Ulysses (u > 1, ring = 1; Q, K the plan-padded head widths; `fused_ulysses_backward_temp`): the largest
  of dout's exchange (2 e Q), the kernel one kv head at a time (the received dout e Q and one kv group's
  gradients) and the gradient exchange, whose send buffer is the saved q/k/v buffer itself and which frees the
  saved output and lse first (its receive buffer e (Q + 2 K), then the sequence-space dq, dk, dv e (q + 2 kv) once
  the saved buffer is freed); the attention output `a` (saved by the second piece) is freed by then;
  USP (u > 1, ring > 1): the head-space gradient e Q and the zigzag ring's busiest step on the head-space
  widths (measured with u = 2, ring = 2);
- the first piece's backward (`TiledTerms.qkv_*`: after attention's, the largest moment of a world of 1 since
  attention runs as one kernel call there): the q/k/v gradients e (q + 2 kv) coming in, the second piece's
  layer-input gradient and the first piece's input-gradient buffer (e h each), one tile's recompute and
  gradients, the piece's parameter gradients twice (the sum over tiles, in fp32, and the tile's own). With
  checkpointing the layer's recomputed tensors, attention's saved q, k, v, out, lse included, stay alive until
  the layer's input gradient is formed (non-reentrant checkpointing keeps what it recomputed for the layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.ulysses import head_plan
from .model import ModelFacts

__all__ = ["TiledTerms", "tiled_terms", "tiled_saved_per_token", "layer_tiles", "attention_backward_temp",
           "fused_ulysses_backward_temp", "ring_backward_temp", "cuda_attention_workspace", "auto_head_chunks"]


def tiled_saved_per_token(m: ModelFacts, elt: int, u: int) -> int:
    """A tiled layer's saved bytes per local token: its input + attention's saved tensors."""
    e, d = elt, m.head_dim
    if u == 1:
        attn = e * (2 * m.q_dim + 2 * m.kv_dim) + 4 * m.heads
    else:
        plan = head_plan(m.heads, m.kv_heads, u)
        hq, hkv = plan.padded_heads, plan.expanded_kv_heads
        attn = e * (2 * hq + 2 * hkv) * d + 4 * hq + e * m.q_dim  # head space + the sequence-space output
    return e * m.hidden + attn


def layer_tiles(m: ModelFacts, local_per_row: int) -> int:
    """seqpar.memory.tiled_compute's automatic tile count: ceil(S_local / hidden), at least 1."""
    return max(1, min(local_per_row, -(-local_per_row // m.hidden)))


def cuda_attention_workspace(m: ModelFacts, elt: int, u: int) -> int:
    """Bytes per local token FlashAttention-2's (and cuDNN's, the same on the H200) backward allocates inside the
    call: an fp32 dQ accumulator and the softmax statistics at the q heads, and, where K/V have fewer heads (GQA),
    dK and dV at the q heads before the group sum. Measured on an H200 (docs/gpu.md): with it the 2-layer
    Llama-8B-shaped runs with every memory feature are planned within 1.1% at 64K and 256K (6.7% / 20.5% under
    without it). Per local token the same under Ulysses (S x u tokens, 1/u of the heads)."""
    plan_q = head_plan(m.heads, m.kv_heads, u) if u > 1 else None
    wq = plan_q.padded_heads * m.head_dim if plan_q else m.q_dim
    hq = plan_q.padded_heads if plan_q else m.heads
    gqa = m.kv_heads < m.heads
    return 4 * wq + 4 * hq + (2 * elt * wq if gqa else 0)


def _local_widths(m: ModelFacts, u: int) -> tuple[int, int]:
    """q and kv widths a kernel call sees per local token (Ulysses: the plan's padded head space)."""
    if u == 1:
        return m.q_dim, m.kv_dim
    plan = head_plan(m.heads, m.kv_heads, u)
    return plan.padded_heads * m.head_dim, plan.expanded_kv_heads * m.head_dim


def auto_head_chunks(m: ModelFacts, u: int, device: str = "cuda") -> int:
    """The head chunks the planner picks: on CUDA 8, or as many as a kernel call has q heads if fewer (each chunk
    keeps whole q heads); on a CPU 1 (its kernel has no workspace to cut)."""
    if device != "cuda":
        return 1
    wq, _ = _local_widths(m, u)
    return max(1, min(8, wq // (m.head_dim * u)))  # q heads per kernel call: 1/u of the plan's on each rank


def attention_backward_temp(m: ModelFacts, elt: int, u: int, ring: int = 1, device: str = "cpu",
                            head_chunks: int = 1) -> int:
    """Bytes per local token seqpar's attention backward allocates beside its saved tensors, at its largest
    moment (module docstring), with the incoming attention-output gradient e q. For u > 1 the saved
    sequence-space output (the second piece's input, released with that piece's backward) is subtracted.
    device "cuda": plus the CUDA kernels' own backward workspace (`cuda_attention_workspace`).
    head_chunks > 1 (attention.heads): the workspace of one group of heads at a time, and that group's kernel
    outputs beside the full dq / dk / dv they are copied into."""
    e = elt
    if u > 1 and ring == 1:
        return fused_ulysses_backward_temp(m, e, u, device, head_chunks)
    wq, wkv = _local_widths(m, u)
    # inside a kernel call: its workspace (CUDA) and, in head chunks, one group's outputs beside the full ones;
    # a call has at most as many groups as q heads (one group: the kernel runs as it is)
    head_chunks = max(1, min(head_chunks, wq // (m.head_dim * u)))
    call = -(-(cuda_attention_workspace(m, e, u) if device == "cuda" else 0) // head_chunks)
    if head_chunks > 1:
        call += -(-e * (wq + 2 * wkv) // head_chunks)
    return _attention_backward_base(m, e, u, ring) + call


def fused_ulysses_backward_temp(m: ModelFacts, e: int, u: int, device: str = "cpu", head_chunks: int = 1) -> int:
    """Pure Ulysses' backward (attention.ulysses_fused) beside its saved tensors (x = the received q, k, v, e (Q + 2K);
    the kernel's output e Q and lse 4 Hq; Q, K the plan's head widths), per local token, at the largest of its
    moments (docs/attention.md, "Ulysses' bytes"):
    - dout's exchange: its send and receive buffers, e Q each;
    - the kernel, one kv head (and its q group) at a time: the received dout e Q and one group's dq, dk, dv
      (e (Q + 2K) / kv heads per rank), CUDA's workspace of one group (head_chunks split it further);
    - the gradient exchange: x is its send buffer, the output, lse and received dout are freed: the receive
      buffer e (Q + 2K) less e Q + 4 Hq;
    - dq, dk, dv in sequence space, e (q + 2 kv), with x freed: the same less."""
    plan = head_plan(m.heads, m.kv_heads, u)
    wq, wkv = _local_widths(m, u)
    groups = max(1, plan.expanded_kv_heads // u)  # kv heads per rank: one backward kernel call each
    calls = max(groups, min(head_chunks, max(1, plan.padded_heads // u)))  # head chunks split a group's q heads
    call = -(-(cuda_attention_workspace(m, e, u) if device == "cuda" else 0) // calls)
    if calls > groups:  # attention.heads: one chunk's outputs beside its group's
        call += -(-e * (wq + 2 * wkv) // calls)
    kernel = e * wq + -(-e * (wq + 2 * wkv) // groups) + call
    freed = e * wq + 4 * plan.padded_heads
    return max(2 * e * wq, kernel, e * (wq + 2 * wkv) - freed, e * (m.q_dim + 2 * m.kv_dim) - freed)


def _attention_backward_base(m: ModelFacts, e: int, u: int, ring: int) -> int:
    """attention_backward_temp without the kernel call's own terms (what the CPU meter measured); not pure Ulysses
    (`fused_ulysses_backward_temp`)."""
    if u == 1 and ring == 1:  # the local attention: the kernel's dq, dk, dv in the input dtype, nothing else
        return e * m.q_dim + e * (m.q_dim + 2 * m.kv_dim)
    if u == 1:  # ring path
        return e * m.q_dim + ring_backward_temp(m.q_dim, m.kv_dim, e, ring)
    wq, wkv = _local_widths(m, u)
    # USP: the gradient in head space (the sequence-space one is freed), then the ring on u x the tokens and 1/u
    # of the heads (the same bytes per local token), sending a copy of its own K/V block
    return e * wq + ring_backward_temp(wq, wkv, e, ring, send_copy=True) - e * m.q_dim


def ring_backward_temp(q: int, kv: int, e: int, n: int, send_copy: bool = False) -> int:
    """Bytes per local token of the zigzag ring backward (causal, ring size n, widths q and kv) at its largest
    moment over ranks and steps, beside the saved q, k, v, out, lse (seqpar.attention.ring, measured): the
    fp32 dq accumulator; the K/V block being used and the next one arriving (e each); the fp32 dK/dV pairs:
    this block's, from step 1 the own block's, from step 2 the previous block's in its send and the next
    partial sum arriving; the kernel's outputs of one piece (the whole block for n = 1; on the diagonal step
    a quarter block of each, a half per token; on later steps dK/dV of half the keys when the block is earlier
    than the rank's own, dQ of half the queries when it is later).
    send_copy: the own K/V block is not contiguous (USP's views into the exchange buffer), so its first send
    copies it."""
    acc, pair_kv, pair_acc = 4 * q, 2 * e * kv, 2 * 4 * kv
    piece = e * (q + 2 * kv) // (2 if n > 1 else 1)
    best = acc + ((2 if send_copy else 1) * pair_kv if n > 1 else 0) + pair_acc + piece  # step 0: the diagonal
    # at every later step s some rank has an earlier block (ranks r >= s) and some a later one (r < s)
    half = e * max(q + kv, q // 2 + 2 * kv)
    for s in range(1, n):
        arriving = pair_kv if s < n - 1 else 0
        best = max(best, acc + pair_kv + arriving + (4 if s >= 2 else 2) * pair_acc + half,
                   acc + pair_kv + arriving + 3 * pair_acc)  # computing / after the block's send started
    return best


@dataclass(frozen=True)
class TiledTerms:
    current: int  # bytes per token: the layer's recompute (input + attention's saved tensors)
    mlp_acts: int  # bytes: one tile's recompute of the second piece
    mlp_temp: int  # bytes: its gradients and the full-length gradient buffers
    down: int  # bytes: the second piece's parameter gradients (summed over the tiles)
    attn_temp: int  # bytes per token at attention's backward
    qkv_temp: int  # bytes per token at the first piece's backward (q/k/v gradients in, two [*, h] buffers)
    qkv_tile: int  # bytes: one tile's recompute and gradients there
    qkv_grads: int  # bytes: the first piece's parameter gradients there (summed over tiles + the tile's own)


def tiled_terms(m: ModelFacts, elt: int, u: int, rows: int, local_per_row: int, tokens: int,
                weights_train: bool, elt_params: int, ring: int = 1, o_proj_in: int = 0,
                device: str = "cpu", head_chunks: int = 1) -> TiledTerms:
    """o_proj_in: bytes per token o_proj (or its adapter) keeps of its input and adapter output, when training."""
    e, h, i = elt, m.hidden, m.intermediate
    tiles = layer_tiles(m, local_per_row)
    tile = rows * -(-local_per_row // tiles)
    if weights_train:  # fp32 input + rsqrt, normalised x, output; gate, silu(gate), up (their product, down_proj's
        kept = 4 * h + 4 + 2 * e * h + 3 * e * i  # input, is consumed by then)
    else:  # frozen norm and MLP (LoRA on attention): rsqrt (+ the fp32 copy in bf16), gate, silu(gate), up (measured)
        kept = 4 + (4 * h if e == 2 else 0) + 3 * e * i
    # + the tile's middle residual stream and its output (held until the tile's gradient call returns); with
    # rows > 1 a tile is a strided slice, which o_proj copies to keep as its input
    kept += 2 * e * h + (o_proj_in if rows > 1 and tiles > 1 else 0)
    tile_grads = 3 * e * i * tile
    buffers = (e * h + e * m.q_dim + e * h) * tokens  # incoming gradient, attention-output and input buffers
    down = (m.q_dim * h + 3 * h * i + h) * elt_params if weights_train else 0
    qkv = m.q_dim + 2 * m.kv_dim
    # first piece's tile at its gradient call (measured, fp32 / bf16 / LoRA): four q/k/v-wide tensors (projection
    # and RoPE outputs, their gradients), four fp32 [tile, h] tensors of the norm (six when its weight trains)
    # and two e h ones (norm output and its gradient)
    qkv_tile = tile * (4 * e * qkv + (6 if weights_train else 4) * 4 * h + 2 * e * h)
    qkv_grads = (h * qkv + h) * (4 + e) if weights_train else 0  # summed in fp32, plus the tile's own
    return TiledTerms(tiled_saved_per_token(m, elt, u), kept * tile, tile_grads + buffers, down,
                      e * h + attention_backward_temp(m, e, u, ring, device, head_chunks), 2 * e * h + e * qkv,
                      qkv_tile, qkv_grads)
