"""Per-rank peak memory of one training step, counted from the saved tensors of a decoder layer.

Not a curve fit: every term is a tensor that autograd keeps (or a step allocates), per token of this
rank's shard, in its dtype (e = 2 for bf16, 4 for fp32; softmax statistics and norm internals are fp32).
Checked against torch's MemTracker by `seqpar plan --validate` (planner.validate), with and without
the memory features.

Saved per decoder layer and token (no memory features, full fine-tuning):
- each RMSNorm: its fp32 input (the residual itself in fp32, an fp32 copy in bf16) 4h, rsqrt 4,
  normalised x (kept for the weight's gradient) e*h, its output (kept by the next Linear) e*h;
- q/k norms (Qwen3): the projection output (fp32) 4(q+kv), rsqrt 4(Hq+Hkv), normalised e(q+kv);
- attention: q, k, v after RoPE and the output e(q+2kv+q), lse 4*Hq; with Ulysses the all-to-all
  copies in head space (dummy heads / replicated kv included, from the ulysses head plan) replace
  q, k, v, plus the head-space output and the sequence-space output;
- MLP: gate, silu(gate), up, silu*up: 4e*I (silu*up only when down_proj trains).
Per token once: RoPE cos/sin 2e*D, int64 positions/labels 24 B, the final norm.

The peak is the largest of these moments (`estimate_memory`'s `phases`):
- loss_backward, at log_softmax's backward: every activation above, plus 12*V bytes per position
  with logits (the fp32 log-softmax kept, its gradient, the logits' gradient). Without the fused loss
  every position has logits. With it only supervised positions do (`Workload.unsupervised_tokens`:
  prompt positions, a row's last one), one checkpointed chunk of them at a time, recomputed in
  backward (its e-byte logits are upcast, or in fp32 the same tensor, and not saved); the loss keeps
  the supervised hidden states (e*h). Under FSDP2 the root's pre-backward hook has gathered the last
  layer before the fused chunks run backward (they are inside the model's forward).
- layer_backward, the larger of two moments of one layer's backward (`_layer_backward`): the MLP
  product's backward (this layer's saved tensors or, with checkpointing, its recompute, less
  down_proj's consumed input; the layers ahead, or only their inputs with checkpointing; the
  residual-stream gradient e*h and three [*, I] gradients 3e*I; parameter gradients so far; FSDP2's
  gathered + prefetched layers and the previous layer's reduce-scatter), and attention's backward
  (the MLP's tensors gone; dq, dk, dv; the all-to-all / ring / FSDP buffers). With tiled MLP the
  [*, I] terms are one tile's (recomputed); one tile (S_local <= hidden) runs the plain MLP.
- optimizer: parameters + gradients + AdamW moments + the step's temporary.
Activation checkpointing keeps one layer input (e*h) per layer instead of its saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..attention.ulysses import head_plan
from .model import ModelFacts
from .tiled import attention_backward_temp, tiled_saved_per_token, tiled_terms

__all__ = ["Features", "Workload", "Layout", "MemoryBreakdown", "estimate_memory", "activation_bytes_per_token",
           "DEFAULT_LOSS_CHUNK_BYTES", "INDEX_BYTES_PER_TOKEN"]

DEFAULT_LOSS_CHUNK_BYTES = 256 * 2**20  # MemorySpec.loss_chunk_tokens=None: one chunk's fp32 logits <= 256 MB
INDEX_BYTES_PER_TOKEN = 24  # int64 position_ids / shift_labels / their long copies


@dataclass(frozen=True)
class Features:
    activation_checkpointing: bool = False
    offload_activations: bool = False
    fused_loss: bool = False
    tiled_mlp: bool = False
    tiled_layer: bool = False  # the whole layer but attention in sequence tiles (planner.tiled)
    fsdp: bool = False
    offload_optimizer: bool = False  # FSDP CPU offload of parameters, gradients and optimizer state
    loss_chunk_tokens: int | None = None
    # offload on an accelerator prefetches the next layer input during a layer's backward (a second input on
    # the device); seqpar.memory.offload on CPU copies on demand (the validation runs)
    offload_prefetch: bool = True

    def as_dict(self) -> dict[str, bool]:
        return {k: v for k, v in self.__dict__.items() if k not in ("loss_chunk_tokens", "offload_prefetch")}


@dataclass(frozen=True)
class Workload:
    seq_len: int
    stage: str = "sft"
    finetuning: str = "full"
    precision: str = "bf16"
    micro_batch_size: int = 1
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # positions per row without a label (prompt tokens, a row's last position): the fused loss computes
    # logits only for supervised positions. 0 = every position supervised (the upper bound).
    unsupervised_tokens: int = 0

    @property
    def elt(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def rows(self) -> int:
        return self.micro_batch_size * (2 if self.stage == "dpo" else 1)  # DPO: chosen + rejected rows

    @property
    def lora(self) -> bool:
        return self.finetuning == "lora"

    def supervised(self, local_tokens: int) -> int:
        """Supervised positions on the busiest rank: all its tokens, at most the rows' supervised total."""
        return max(1, min(local_tokens, self.rows * (self.seq_len - self.unsupervised_tokens)))

    def trains(self, module: str) -> bool:
        """Whether a Linear keeps its input for a weight gradient (trained, or a LoRA target)."""
        return not self.lora or module in self.lora_targets


@dataclass(frozen=True)
class Layout:
    ulysses: int = 1
    ring: int = 1
    dp: int = 1

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def world(self) -> int:
        return self.sp * self.dp


@dataclass
class MemoryBreakdown:
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    loss_chunk: int
    comm_buffers: int
    temp: int
    phase: str  # which moment of the step is the peak: loss_backward | layer_backward | optimizer
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_state + self.activations + self.loss_chunk
                + self.comm_buffers + self.temp)

    def as_dict(self) -> dict[str, int]:
        d = {k: int(getattr(self, k)) for k in ("parameters", "gradients", "optimizer_state", "activations",
                                                "loss_chunk", "comm_buffers", "temp")}
        d["total"] = int(self.total)
        return d


def _norm(m: ModelFacts, e: int, input_grad: bool, weight_trains: bool, consumer_saves: bool) -> int:
    """Bytes one RMSNorm keeps per token: fp32 input + rsqrt, normalised x (weight grad), output (consumer)."""
    n = (4 * m.hidden + 4) if input_grad else 0
    return n + (e * m.hidden if weight_trains else 0) + (e * m.hidden if consumer_saves else 0)


def _attention(m: ModelFacts, wl: Workload, u: int) -> int:
    e, d = wl.elt, m.head_dim
    n = 0
    if m.qk_norm:
        full = not wl.lora
        n += 4 * (m.q_dim + m.kv_dim) + 4 * (m.heads + m.kv_heads) + (e * (m.q_dim + m.kv_dim) if full else 0)
    if u == 1:
        return n + e * (2 * m.q_dim + 2 * m.kv_dim) + 4 * m.heads
    plan = head_plan(m.heads, m.kv_heads, u)
    hq, hkv = plan.padded_heads, plan.expanded_kv_heads
    # per LOCAL token: the head-space q, k, v, output and lse of P tokens x 1/P of the heads
    n += e * (2 * hq + 2 * hkv) * d + 4 * hq
    return n + (e * m.q_dim if wl.trains("o_proj") else 0)  # the sequence-space output o_proj keeps


def _lora(m: ModelFacts, wl: Workload) -> int:
    return wl.elt * wl.lora_r * sum(1 for t in wl.lora_targets) if wl.lora else 0


def _mlp(m: ModelFacts, wl: Workload, tiled: bool) -> int:
    if tiled:
        return 0  # tiles are recomputed in backward: nothing [S, intermediate] stays alive
    return wl.elt * m.intermediate * (3 + (1 if wl.trains("down_proj") else 0))


def layer_bytes_per_token(m: ModelFacts, wl: Workload, u: int, tiled_mlp: bool = False) -> int:
    """What one decoder layer keeps for backward, per local token (no checkpointing)."""
    e, full = wl.elt, not wl.lora
    qkv = any(wl.trains(t) for t in ("q_proj", "k_proj", "v_proj"))
    mlp_in = any(wl.trains(t) for t in ("gate_proj", "up_proj"))
    return (_norm(m, e, True, full, qkv) + _attention(m, wl, u) + _norm(m, e, True, full, mlp_in or tiled_mlp)
            + _mlp(m, wl, tiled_mlp) + _lora(m, wl))


def mlp_tiles(m: ModelFacts, wl: Workload, lay: Layout) -> int:
    """memory.tiled_mlp's automatic tile count (seqpar.memory.tiled_mlp.auto_tile_count) for one row of
    this rank's shard; 1 tile runs the plain MLP (nothing is checkpointed)."""
    local = max(1, wl.seq_len // lay.sp)
    return max(1, min(local, -(-local // m.hidden)))


def activation_bytes_per_token(m: ModelFacts, wl: Workload, u: int, feats: Features) -> int:
    """Bytes alive per local token at the end of forward (loss working set excluded)."""
    e, full = wl.elt, not wl.lora
    once = 2 * e * m.head_dim + INDEX_BYTES_PER_TOKEN  # RoPE cos/sin, int64 index tensors
    once += _norm(m, e, True, full, full and not feats.fused_loss)  # final norm (lm_head keeps its output)
    if feats.fused_loss:
        once += e * m.hidden  # the supervised hidden states the loss chunks keep
    if feats.activation_checkpointing:
        kept = 0 if feats.offload_activations else m.layers  # offload: every layer input is in the host store
        return once + kept * e * m.hidden  # (layer 0's input is kept even when the embedding is frozen)
    if feats.tiled_layer:
        return once + m.layers * tiled_saved_per_token(m, e, u)
    if wl.lora:
        once -= 4 * m.hidden + 4  # a frozen embedding: layer 0's norm input needs no gradient
    return once + m.layers * layer_bytes_per_token(m, wl, u, feats.tiled_mlp)


def _param_bytes(m: ModelFacts, wl: Workload, feats: Features, world: int) -> tuple[int, int, int, int, int]:
    """(resident params at peak, gradients at the optimizer step, optimizer state, optimizer temp, one layer's
    gathered params), on the device. The optimizer always updates fp32 weights: FSDP2's fp32 shards, or
    without FSDP in bf16 seqpar train's fp32 masters (train.model.precision.MasterWeights) beside the bf16
    model, whose gradients are copied to fp32 ones on the masters before the update. With FSDP2 CPU offload
    the shards, their gradients and AdamW's moments live on the host (`host_bytes`): the device keeps the
    gathered root module and the gathered layers only."""
    e, n = wl.elt, m.num_params()
    layer = m.layer_params() * e
    root = (m.embed_params() + m.lm_head_params() + m.hidden) * e  # the root module stays gathered
    masters = e == 2 and not feats.fsdp  # bf16 without FSDP: fp32 copies of the trainable weights
    if wl.lora:
        t = m.lora_params(wl.lora_r, wl.lora_targets)
        base = n * e + t * e
        if feats.fsdp and feats.offload_optimizer:
            return root, 0, 0, 0, layer + t // m.layers * e
        if feats.fsdp:  # the adapters are sharded like every other parameter, and so are their moments
            base = base // world + root
            return base, t * e // world, 2 * t * e // world, t * e // world, layer + t // m.layers * e
        if masters:
            return base + 4 * t, 4 * t, 8 * t, 4 * t, 0
        return base, t * e, 2 * t * e, t * e, 0
    if not feats.fsdp:
        # the trained weights (fp32, or bf16 + fp32 masters), fp32 gradients and AdamW moments, one foreach temp
        return n * e + (4 * n if masters else 0), 4 * n, 8 * n, 4 * n, 0
    if feats.offload_optimizer:
        return root, 0, 0, 0, layer
    shard = n * 4 // world  # fp32 master shards
    return shard + root, shard, 2 * shard, shard, layer


def host_bytes(m: ModelFacts, wl: Workload, lay: Layout, feats: Features) -> dict[str, int]:
    """Host (CPU) memory one rank fills: the offloaded checkpointed layer inputs (every layer's, e h bytes per
    local token) and, with FSDP2 CPU offload, the fp32 parameter shards, their gradients and AdamW's two
    moments (16 bytes per trainable parameter / world, frozen LoRA weights e bytes / world)."""
    tokens = wl.rows * wl.seq_len // lay.sp
    acts = m.layers * wl.elt * m.hidden * tokens if feats.offload_activations else 0
    opt = 0
    if feats.fsdp and feats.offload_optimizer:
        n = m.num_params()
        if wl.lora:
            t = m.lora_params(wl.lora_r, wl.lora_targets)
            opt = (n * wl.elt + 16 * t) // lay.world
        else:
            opt = 16 * n // lay.world
    return {"activations": acts, "optimizer": opt, "total": acts + opt}


def _loss_bytes(m: ModelFacts, wl: Workload, feats: Features, tokens: int) -> int:
    """At log_softmax's backward: the fp32 log-softmax (saved), its gradient and the logits' gradient,
    12 V bytes per token with logits. Without the fused loss every token has logits; with it only one
    checkpointed chunk of supervised tokens, recomputed in backward (its e-byte logits are upcast, or in
    fp32 are the same tensor, and not saved)."""
    if not feats.fused_loss:
        return 12 * m.vocab * tokens
    chunk = feats.loss_chunk_tokens or max(1, DEFAULT_LOSS_CHUNK_BYTES // (4 * m.vocab))
    return 12 * m.vocab * min(chunk, wl.supervised(tokens))


@dataclass(frozen=True)
class _Moment:
    """Bytes beside parameters and optimizer state at one moment of a layer's backward."""

    activations: int
    gradients: int
    temp: int
    comm: int

    @property
    def total(self) -> int:
        return self.activations + self.gradients + self.temp + self.comm


def _layer_backward(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, tokens: int,
                    gathered: int, comm: int) -> tuple[_Moment, _Moment]:
    """(the MLP moment, the attention moment) of the busiest layer backward.

    MLP moment: backward has reached a layer's MLP, down_proj's backward is done, and the gradients of
    silu(gate) and up are being formed. Alive then, per local token: RoPE cos/sin and the index tensors;
    the saved tensors of the layers still ahead (without checkpointing), or their inputs (with it); this
    layer's saved tensors (with checkpointing: its recompute, where the fp32 input of input_layernorm is
    the kept input itself in fp32, a new fp32 copy in bf16) less down_proj's input, already consumed;
    temporaries: the residual-stream gradient e h, down_proj's input gradient e I and the two product
    gradients 2 e I (with tiled MLP the [*, I] terms, recompute included, are one tile's). Parameter
    gradients: the head's, the layers done, this layer's down_proj. FSDP2: this layer gathered, the
    next one prefetched, the previous layer's unsharded gradients in their reduce-scatter; finished
    layers' gradients are shards, the root's (head) stay whole until the end of backward. Activations
    fall and gradients grow from one layer to the next (linearly between the FSDP steps), so the
    first, second, second-to-last and last layer cover the maximum.
    Attention moment: the same, but the layer's MLP tensors are gone, dq, dk, dv (e (q + 2 kv)) and
    the collectives' buffers (all-to-all, ring K/V, FSDP's two gathered layers) are alive.
    """
    e, h, i = wl.elt, m.hidden, m.intermediate
    lb = layer_bytes_per_token(m, wl, lay.ulysses, feats.tiled_mlp)
    down_in = e * i if wl.trains("down_proj") else 0
    if feats.tiled_mlp:  # one tile's MLP tensors, recomputed for its backward
        per_row = max(1, wl.seq_len // lay.sp)
        tile = wl.rows * -(-per_row // mlp_tiles(m, wl, lay))
        mlp_acts, mlp_temp = (_mlp(m, wl, False) - down_in) * tile, 3 * e * i * tile
    else:
        lb -= _mlp(m, wl, False)
        mlp_acts, mlp_temp = (_mlp(m, wl, False) - down_in) * tokens, 3 * e * i * tokens
    if feats.activation_checkpointing:
        current, ahead = lb - (4 * h if e == 4 else 0), e * h  # recompute; the kept input of each layer ahead
        ahead_full = ahead
    else:
        current, ahead = lb, layer_bytes_per_token(m, wl, lay.ulysses, feats.tiled_mlp)
        ahead_full = 0
    attn_temp, tiled, attn_comm, attn_freed = e * (h + m.q_dim + 2 * m.kv_dim), None, comm, 0
    if not feats.tiled_layer and (lay.ulysses == 1 or lay.ring == 1):
        # seqpar's attention backward tensor by tensor (planner.tiled); the post-attention norm's tensors are
        # consumed by then (measured)
        attn_temp = e * h + attention_backward_temp(m, e, lay.ulysses)
        attn_freed = _norm(m, e, True, not wl.lora, feats.tiled_mlp or any(wl.trains(t) for t in ("gate_proj", "up_proj")))
        if lay.ulysses > 1:  # the fused exchange's buffers are in attn_temp
            attn_comm -= _ulysses_buffers(m, e, lay.ulysses, tokens)
    if feats.tiled_layer:  # planner.tiled: the layer keeps its input + attention's tensors; pieces run in tiles
        tiled = tiled_terms(m, e, lay.ulysses, wl.rows, max(1, wl.seq_len // lay.sp), tokens, not wl.lora, e)
        ckpt = feats.activation_checkpointing
        current, ahead = tiled.current - (e * h if ckpt else 0), (e * h if ckpt else tiled.current)
        mlp_acts, mlp_temp, attn_temp = tiled.mlp_acts, tiled.mlp_temp - e * h * tokens, tiled.attn_temp
        if lay.ulysses > 1 and lay.ring == 1:  # the fused exchange's buffers are in attn_temp (planner.tiled)
            attn_comm -= _ulysses_buffers(m, e, lay.ulysses, tokens)
    acts = (2 * e * m.head_dim + INDEX_BYTES_PER_TOKEN + current) * tokens
    if wl.lora and not feats.activation_checkpointing:
        acts -= (4 * h + 4) * tokens  # layer 0 keeps no norm input (frozen embedding)
    if wl.lora:
        head, per_layer, down = 0, m.lora_params(wl.lora_r, wl.lora_targets) // m.layers * e, 0
    else:
        head = (m.lm_head_params() or m.embed_params()) * e + h * e
        # tiled MLP: the tiles' backward accumulates gate, up and down gradients together (measured)
        per_layer, down = m.layer_params() * e, (tiled.down if tiled else (3 if feats.tiled_mlp else 1) * h * i * e)
    # at attention's backward the gradients of o_proj, the post-attention norm and the MLP exist (measured)
    post_attn = (m.q_dim * h + 3 * h * i + h) * e if not wl.lora else 0
    in_flight = prefetch = 0
    if feats.fsdp:
        # finished layers' gradient shards stay on the device, or go to the host with CPU offload
        in_flight, prefetch = per_layer, gathered
        per_layer = 0 if feats.offload_optimizer else per_layer // lay.world
    last = m.layers - 1

    norm_acts = _input_norm_moment(m, wl, lay.ulysses) if feats.activation_checkpointing and not tiled else 0

    def at(k: int, moment: str) -> _Moment:  # k layers already done
        # offloaded layer inputs: only the next one, prefetched, is back on the device
        ahead_n = (min(1, last - k) * feats.offload_prefetch) if feats.offload_activations else last - k
        a = acts + (ahead * ahead_n + ahead_full) * tokens
        rs = in_flight if k > 0 else 0
        if moment == "attention":
            return _Moment(a - attn_freed * tokens, head + k * per_layer + post_attn, attn_temp * tokens, attn_comm + rs)
        if moment == "norm":  # the whole layer's gradients exist (FSDP: unsharded, before its reduce-scatter)
            a = (2 * e * m.head_dim + INDEX_BYTES_PER_TOKEN + norm_acts + ahead * ahead_n) * tokens
            grads = head + k * per_layer + (in_flight or per_layer)
            return _Moment(a, grads, NORM_BACKWARD_TEMP * h * tokens, gathered + rs)
        return _Moment(a + mlp_acts, head + k * per_layer + down, e * h * tokens + mlp_temp,
                       gathered + (prefetch if k < last else 0) + rs)

    ks = {0, min(1, last), max(0, last - 1), last}
    mlp_moment = max((at(k, "mlp") for k in ks), key=lambda x: x.total)
    attn = max((at(k, "attention") for k in ks), key=lambda x: x.total)
    # a frozen embedding (LoRA): layer 0's input norm computes no input gradient
    norm_ks = [k for k in ks if k < last or not wl.lora] if norm_acts else []
    return mlp_moment, max([attn, *(at(k, "norm") for k in norm_ks)], key=lambda x: x.total)


# HF's RMSNorm backward (fp32 internals): the gradients through x * rsqrt, mean and pow (x, 2x, their product)
NORM_BACKWARD_TEMP = 5 * 4


def _input_norm_moment(m: ModelFacts, wl: Workload, u: int) -> int:
    """Activations per local token when a checkpointed, untiled layer's input norm runs its backward (the
    largest moment of bf16 and LoRA layers, measured): attention's and the input norm's recompute (its fp32
    input: the layer's kept input in fp32, a copy in bf16), the post-attention norm's fp32 input (in bf16
    beside the residual stream itself) and the adapters' inputs stay alive until the layer's input gradient
    is formed."""
    e, h, full = wl.elt, m.hidden, not wl.lora
    qkv = any(wl.trains(t) for t in ("q_proj", "k_proj", "v_proj"))
    post = 4 * h + (e * h if e == 2 else 0)
    return _norm(m, e, True, full, qkv) + _attention(m, wl, u) + post + _lora(m, wl)


def _ulysses_buffers(m: ModelFacts, e: int, u: int, tokens: int) -> int:
    """Ulysses' all-to-all send + receive buffers of the largest tensor (q, plan-padded heads)."""
    return 2 * e * head_plan(m.heads, m.kv_heads, u).padded_heads * m.head_dim * tokens


def _comm_bytes(m: ModelFacts, wl: Workload, lay: Layout, tokens: int, layer_params: int) -> int:
    """Transient communication buffers of one attention call (and FSDP's gathered layers)."""
    e, d = wl.elt, m.head_dim
    n = 0
    if lay.ulysses > 1:
        n += _ulysses_buffers(m, e, lay.ulysses, tokens)
    if lay.ring > 1:
        kv_local = m.kv_dim if lay.ulysses == 1 else head_plan(m.heads, m.kv_heads, lay.ulysses).expanded_kv_heads * d
        ring_tokens = tokens * lay.ulysses  # a ring block holds the ulysses group's tokens, 1/u of the heads
        n += 2 * 2 * (e + 4) * kv_local // lay.ulysses * ring_tokens  # K,V in flight + fp32 dK,dV in flight
    return n + 2 * layer_params  # FSDP: the running and the prefetched layer


def estimate_memory(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, *,
                    foreach: bool = True) -> MemoryBreakdown:
    """Peak bytes on one rank: the largest of three moments of the step (see module docstring).

    foreach: AdamW's multi-tensor path (the default on GPUs) allocates one temporary the size of all
    trainable parameters; the CPU single-tensor path only the largest tensor's. Without FSDP and with
    more than one rank, seqpar.loss.sum_gradients flattens all gradients into one buffer first.
    """
    tokens = wl.rows * wl.seq_len // lay.sp
    params, grads, opt, opt_temp, layer = _param_bytes(m, wl, feats, lay.world)
    if not foreach and not (lay.world > 1 and not feats.fsdp):
        opt_temp = min(opt_temp, max(m.embed_params(), m.hidden * m.intermediate) * 4)
    # The frozen reference copy of full-fine-tuning DPO; under FSDP2 sharded over all ranks like the policy.
    ref = m.num_params() * wl.elt // (lay.world if feats.fsdp else 1) if wl.stage == "dpo" and not wl.lora else 0
    params += ref
    if feats.tiled_mlp and mlp_tiles(m, wl, lay) == 1:
        feats = replace(feats, tiled_mlp=False)  # one tile: the plain MLP runs, nothing is recomputed
    acts = activation_bytes_per_token(m, wl, lay.ulysses, feats) * tokens
    loss = _loss_bytes(m, wl, feats, tokens)
    comm = _comm_bytes(m, wl, lay, tokens, layer)
    mlp_bwd, attn_bwd = _layer_backward(m, wl, lay, feats, tokens, layer, comm)
    bwd = mlp_bwd if mlp_bwd.total >= attn_bwd.total else attn_bwd
    if feats.fused_loss and feats.fsdp:
        loss += layer  # FSDP2's pre-backward hook on the outputs gathers the last layer before the chunks run
    phases = {
        "loss_backward": params + opt + acts + loss,
        "layer_backward": params + opt + bwd.total,
        "optimizer": params + grads + opt + opt_temp,
    }
    phase = max(phases, key=phases.get)
    if phase == "loss_backward":
        return MemoryBreakdown(params, 0, opt, acts, loss, 0, 0, phase, phases)
    if phase == "layer_backward":
        return MemoryBreakdown(params, bwd.gradients, opt, bwd.activations, 0, bwd.comm, bwd.temp, phase, phases)
    return MemoryBreakdown(params, grads, opt, 0, 0, 0, opt_temp, phase, phases)
