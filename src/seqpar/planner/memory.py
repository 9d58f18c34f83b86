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
- layer_backward, the largest of three moments of one layer's backward (planner.backward): the MLP
  product's backward (this layer's saved tensors or, with checkpointing, its recompute, less
  down_proj's consumed input; the layers ahead, or only their inputs with checkpointing; the
  residual-stream gradient e*h and three [*, I] gradients 3e*I; parameter gradients so far; FSDP2's
  gathered + prefetched layers and the previous layer's reduce-scatter), attention's backward (the MLP's
  and the post-attention norm's tensors gone; seqpar's attention backward counted tensor by tensor; the
  ring / FSDP buffers) and, checkpointed without the tiled layer, the input norm's backward (HF RMSNorm's
  fp32 temporaries at the full local length). With tiled MLP the [*, I] terms are one tile's
  (recomputed); one tile (S_local <= hidden) runs the plain MLP.
- optimizer: parameters + gradients + AdamW moments + the step's temporary.
Activation checkpointing keeps one layer input (e*h) per layer instead of its saved tensors.
"""


from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..comm import IN_PLACE_MIN_NUMEL
from ..errors import SeqParError
from .backward import layer_backward
from .layer import activation_bytes_per_token, layer_bytes_per_token, mlp_tiles
from .model import ModelFacts
from .tiled import layer_tiles
from .workload import DEFAULT_LOSS_CHUNK_BYTES, INDEX_BYTES_PER_TOKEN, Features, Layout, Workload

__all__ = ["Features", "Workload", "Layout", "MemoryBreakdown", "estimate_memory", "activation_bytes_per_token",
           "layer_bytes_per_token", "host_bytes", "DEFAULT_LOSS_CHUNK_BYTES", "INDEX_BYTES_PER_TOKEN", "loss_bytes",
           "final_norm_bytes"]


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
        # the trained weights (fp32, or bf16 + fp32 masters), fp32 gradients, AdamW moments, a foreach temp
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


def loss_bytes(m: ModelFacts, wl: Workload, feats: Features, tokens: int) -> int:
    """At log_softmax's backward: the fp32 log-softmax (saved), its gradient and the logits' gradient,
    12 V bytes per token with logits. Without the fused loss every token has logits; with it only one
    checkpointed chunk of supervised tokens, recomputed in backward (its e-byte logits are upcast, or in
    fp32 are the same tensor, and not saved), plus per supervised token: their int64 positions and
    targets (16 B), the fp32 gradient of the per-token NLL (4 B) and, from the second chunk's backward on,
    the gradient the chunks' hidden-state slices accumulate into (e*h). A final-logit softcap keeps its tanh's
    output, e V more per token with logits (measured: tiny RecurrentGemma)."""
    per = 12 + (wl.elt if m.logit_softcap else 0)  # a softcap's tanh output (e V) is kept for its backward
    if not feats.fused_loss:
        return per * m.vocab * tokens
    chunk = feats.loss_chunk_tokens or max(1, DEFAULT_LOSS_CHUNK_BYTES // (4 * m.vocab))
    supervised = wl.supervised(tokens)
    accumulated = wl.elt * m.hidden * supervised if supervised > chunk else 0
    return per * m.vocab * min(chunk, supervised) + 20 * supervised + accumulated


def final_norm_bytes(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, tokens: int) -> int:
    """The final norm's backward, right after the loss head's: HF's RMSNorm backward's fp32 [*, h] temporaries
    (four) beside the hidden-state gradient and the loss's per-token index tensors, 16 h + 60 bytes per token
    (measured in bf16 with memory.keep_attention, whose kept outputs put this moment above the others); with the
    tiled layer the norm runs in tiles too (memory.tiled_compute): one tile's temporaries and the full-length
    input-gradient buffer the tiles write into."""
    if feats.tiled_layer:
        per_row = max(1, wl.seq_len // lay.sp)
        tile = wl.rows * -(-per_row // layer_tiles(m, per_row))
        return 16 * m.hidden * tile + (wl.elt * m.hidden + 60) * tokens
    return (16 * m.hidden + 60) * tokens


def estimate_memory(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, *,
                    optimizer: str = "fused") -> MemoryBreakdown:
    """Peak bytes on one rank: the largest of three moments of the step (see module docstring).

    optimizer: seqpar train's `optimizer.implementation`. "fused" (its default) updates every tensor in place
    with no temporary; "foreach" allocates one temporary the size of all trainable parameters; "for_loop" two
    of the largest tensor's (sqrt(v), then its quotient by the bias correction; measured). Without FSDP on
    more than one rank, seqpar.loss.sum_gradients reduces the large gradients in place and copies the small
    ones (below IN_PLACE_MIN_NUMEL elements) into one fp32 buffer first: the larger of that buffer and the
    step's temporary.
    """
    tokens = wl.rows * wl.seq_len // lay.sp
    params, grads, opt, opt_temp, layer = _param_bytes(m, wl, feats, lay.world)
    if optimizer == "fused":
        opt_temp = 0
    elif optimizer == "for_loop":
        big = m.hidden * m.intermediate if m.moe is None else max(m.moe.tensors(m.hidden))  # MoE: the experts'
        opt_temp = min(opt_temp, 2 * max(m.embed_params(), big) * 4)
    elif optimizer != "foreach":
        raise SeqParError(f"unknown optimizer implementation {optimizer!r}: use fused, foreach or for_loop")
    if lay.world > 1 and not feats.fsdp:
        opt_temp = max(opt_temp, 4 * sum(n for n in wl.trained_tensors(m) if n < IN_PLACE_MIN_NUMEL))
    # The frozen reference copy of full-fine-tuning DPO; under FSDP2 sharded over all ranks like the policy.
    ref = m.num_params() * wl.elt // (lay.world if feats.fsdp else 1) if wl.stage == "dpo" and not wl.lora else 0
    params += ref
    if feats.tiled_mlp and mlp_tiles(m, wl, lay) == 1:
        feats = replace(feats, tiled_mlp=False)  # one tile: the plain MLP runs, nothing is recomputed
    acts = activation_bytes_per_token(m, wl, lay.ulysses, feats, lay.ring) * tokens
    loss = max(loss_bytes(m, wl, feats, tokens), final_norm_bytes(m, wl, lay, feats, tokens))
    mlp_bwd, attn_bwd = layer_backward(m, wl, lay, feats, tokens, layer)
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
