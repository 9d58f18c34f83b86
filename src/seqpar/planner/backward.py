"""The busiest moments of one decoder layer's backward (planner.memory's `layer_backward` phase): the MLP
product's backward, attention's backward and, for an untiled checkpointed layer, its input norm's backward."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .family_memory import family_mlp_kind
from .layer import (
    attention_bytes,
    kept_attention_bytes,
    layer_bytes_per_token,
    lora_bytes,
    mlp_bytes,
    mlp_tiles,
    norm_bytes,
    rope_bytes,
)
from .model import ModelFacts
from .recurrent_memory import mixer_backward_bytes, mixer_forward_temp
from .tiled import attention_backward_temp, layer_tiles, tiled_terms
from .workload import INDEX_BYTES_PER_TOKEN, Features, Layout, Workload

__all__ = ["Moment", "layer_backward", "NORM_BACKWARD_TEMP"]


@dataclass(frozen=True)
class Moment:
    """Bytes beside parameters and optimizer state at one moment of a layer's backward."""

    activations: int
    gradients: int
    temp: int
    comm: int

    @property
    def total(self) -> int:
        return self.activations + self.gradients + self.temp + self.comm


@dataclass(frozen=True)
class _Alive:
    """What one layer's backward holds beside the layers ahead: bytes per local token unless named _bytes."""

    current: int  # the layer's saved tensors / recompute at the MLP moment, + RoPE and indices
    ahead: int  # each layer still ahead: its kept input (checkpointing) or its saved tensors
    ahead_full: int  # this layer's kept input (checkpointing)
    mlp_bytes: int  # the MLP's tensors (one tile's with tiled MLP)
    mlp_temp_bytes: int  # their gradients (and the tiled layer's full-length buffers)
    attn_temp: int  # attention's backward beside its saved tensors
    attn_freed: int  # consumed before attention's backward: the post-attention norm's tensors
    norm: int  # everything alive at the input norm's backward (untiled, checkpointed); 0: not a moment
    qkv: tuple[int, int, int, int] | None = None  # tiled layer's first-piece moment: (temp per token, tile bytes,
    # its parameter gradients, attention's saved tensors per token freed by then without checkpointing)
    kept_attn: int = 0  # memory.keep_attention: each layer still ahead keeps its kernels' outputs (on the device)
    fwd_temp: int = 0  # a checkpointed recurrent layer's recompute: its mixer's forward temporaries (0: no moment)


def _alive(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, tokens: int, kind: str = "mean") -> _Alive:
    """kind: "mean" (a dense model), or a hybrid's layer kind ("attention" / "recurrent")."""
    e, h, i = wl.elt, m.hidden, m.intermediate
    lb = layer_bytes_per_token(m, wl, lay.ulysses, feats.tiled_mlp, lay.ring, kind)
    down_in = e * i if wl.trains("down_proj") else 0
    temp = 3 * e * i  # the MLP moment's [*, I] gradients
    moe = m.moe if m.family is None else (m.family.moe if family_mlp_kind(m, kind) == "moe" else None)
    if m.family is not None and family_mlp_kind(m, kind) == "dense":
        i = m.family.dense_intermediate
        down_in, temp = e * i, 3 * e * i
    if moe is not None:  # planner.moe: its moment comes before the experts' down grouped_mm consumes its input
        down_in, temp = 0, moe.backward_temp(e, h)
    if feats.tiled_mlp:  # one tile's MLP tensors, recomputed for its backward
        per_row = max(1, wl.seq_len // lay.sp)
        tile = wl.rows * -(-per_row // mlp_tiles(m, wl, lay))
    else:
        lb -= mlp_bytes(m, wl, False, kind) if _has_mlp(m, kind) else 0
        tile = tokens
    mlp_acts, mlp_temp = (mlp_bytes(m, wl, False, kind) - down_in) * tile, temp * tile
    if not _has_mlp(m, kind):  # a block decoder's mixer block: no MLP moment
        mlp_acts = mlp_temp = 0
    ckpt = feats.activation_checkpointing
    if ckpt:  # recompute (in fp32 the input norm's fp32 input is the kept input); the kept input of each layer
        current, ahead = lb - (4 * h if e == 4 else 0), e * h
    else:
        current, ahead = lb, layer_bytes_per_token(m, wl, lay.ulysses, feats.tiled_mlp, lay.ring, kind)
    base = rope_bytes(m, e) + INDEX_BYTES_PER_TOKEN  # RoPE cos/sin, index tensors
    if feats.tiled_layer:  # planner.tiled: the layer keeps its input + attention's tensors; pieces run in tiles
        o_in = (e * m.q_dim + (e * wl.lora_r if wl.lora else 0)) if wl.trains("o_proj") else 0
        t = tiled_terms(m, e, lay.ulysses, wl.rows, max(1, wl.seq_len // lay.sp), tokens, not wl.lora, e, lay.ring,
                        o_in, wl.device, feats.attention_head_chunks)
        current, ahead = t.current - (e * h if ckpt else 0), (e * h if ckpt else t.current)
        attn_saved = 0 if ckpt else t.current - e * h
        return _Alive(base + current, ahead, e * h if ckpt else 0, t.mlp_acts, t.mlp_temp - e * h * tokens,
                      t.attn_temp, 0, 0, (t.qkv_temp, t.qkv_tile, t.qkv_grads, attn_saved))
    mlp_in = feats.tiled_mlp or any(wl.trains(t) for t in ("gate_proj", "up_proj"))
    # seqpar's attention backward tensor by tensor (planner.tiled), its collectives' buffers included
    if kind == "recurrent":  # the recurrent mixer's backward (planner.recurrent_memory) beside its saved tensors
        assert m.recurrent is not None
        attn_temp = e * h + mixer_backward_bytes(m.recurrent, e, lay.ring, wl.seq_len, h)
    elif kind == "mlp":  # a block decoder's MLP block: its MLP moment only
        attn_temp = 0
    else:
        attn_temp = e * h + attention_backward_temp(m, e, lay.ulysses, lay.ring, wl.device,
                                                    feats.attention_head_chunks)
    freed = 0 if m.blocks else norm_bytes(m, e, True, not wl.lora, mlp_in)  # blocks: no post-attention norm
    if wl.lora and not ckpt:
        current -= 4 * h + 4  # layer 0 keeps no norm input (frozen embedding)
    norm = base + input_norm_moment(m, wl, lay.ulysses, lay.ring, kind) if ckpt else 0
    fwd = (mixer_forward_temp(m.recurrent, lay.ring, wl.seq_len, e, m.hidden) if ckpt and kind == "recurrent"
           and m.recurrent else 0)
    return _Alive(base + current, ahead, e * h if ckpt else 0, mlp_acts, mlp_temp, attn_temp, freed, norm,
                  fwd_temp=fwd)


@dataclass(frozen=True)
class _Grads:
    """Parameter-gradient bytes in a layer's backward (FSDP: finished layers as shards)."""

    head: int  # lm_head / embedding + final norm (stay whole until the end of backward)
    per_layer: int  # each finished layer
    down: int  # the layer's own at the MLP moment
    post_attn: int  # ... at attention's backward: o_proj, the post-attention norm, the MLP
    in_flight: int  # FSDP: the previous layer's unsharded gradients in their reduce-scatter
    prefetch: int  # FSDP: the next layer, gathered ahead


def _grads(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, gathered: int) -> _Grads:
    e, h, i = wl.elt, m.hidden, m.intermediate
    if wl.lora:
        head, per_layer, down, post_attn = 0, m.lora_params(wl.lora_r, wl.lora_targets) // m.layers * e, 0, 0
    else:
        head = (m.lm_head_params() or m.embed_params()) * e + h * e
        post_attn = (m.q_dim * h + m.mlp_params() + h) * e  # measured at attention's backward, tiled or not
        # tiled MLP / layer: the tiles' backward accumulates gate, up and down gradients together (measured);
        # a tiled layer of one tile is one backward pass, where down_proj's comes first; from the second tile
        # on, the piece's summed gradients plus the tile's own down_proj gradient (its torch.autograd.grad
        # call returns the tile's gradients together, at its end)
        per_layer = m.layer_params() * e
        tiles = layer_tiles(m, max(1, wl.seq_len // lay.sp)) if feats.tiled_layer else 0
        down = post_attn + h * i * e if tiles > 1 else (3 if feats.tiled_mlp else 1) * h * i * e
        if m.moe is not None:  # the MoE moment: only the shared expert's gate has its gradient (planner.moe)
            down = h * e
    if not feats.fsdp:
        return _Grads(head, per_layer, down, post_attn, 0, 0)
    # finished layers' gradient shards stay on the device, or go to the host with CPU offload
    shard = 0 if feats.offload_optimizer else per_layer // lay.world
    return _Grads(head, shard, down, post_attn, per_layer, gathered)


def layer_backward(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, tokens: int,
                   gathered: int) -> tuple[Moment, Moment]:
    """(the MLP moment, the larger of the attention, input-norm and recompute moments) of the busiest layer backward.

    MLP moment: backward has reached a layer's MLP, down_proj's backward is done, and the gradients of
    silu(gate) and up are being formed. Alive then, per local token: RoPE cos/sin and the index tensors;
    the saved tensors of the layers still ahead (without checkpointing), or their inputs (with it); this
    layer's saved tensors (with checkpointing: its recompute, where the fp32 input of input_layernorm is
    the kept input itself in fp32, a new fp32 copy in bf16) less down_proj's input, already consumed;
    temporaries: the residual-stream gradient e h, down_proj's input gradient e I and the two product
    gradients 2 e I (with tiled MLP the [*, I] terms, recompute included, are one tile's). Parameter
    gradients: the head's, the layers done, this layer's down_proj. FSDP2: this layer gathered, the next one
    prefetched, the previous layer's unsharded gradients in their reduce-scatter; finished layers' gradients
    are shards, the root's stay whole. Activations fall and gradients grow layer by layer, so the first, second,
    second-to-last and last layer cover the maximum (a hybrid's layers: all of them).
    Attention moment: the same, but the layer's MLP tensors and the post-attention norm's are gone, the
    gradients of o_proj, the norm and the MLP exist, and seqpar's attention backward holds its tensors
    (planner.tiled.attention_backward_temp) beside the residual-stream gradient, or a recurrent layer's
    mixer backward (planner.recurrent_memory); the ring's K/V and FSDP's gathered layers are alive.
    Input-norm moment (checkpointed, untiled; not layer 0 under LoRA): the recompute of attention and the input
    norm, the post-attention norm's fp32 input, the layer's gradients and `NORM_BACKWARD_TEMP`. Recompute moment
    (checkpointed recurrent layers): the mixer's forward temporaries, before the layer's gradients.
    """
    g, last = _grads(m, wl, lay, feats, gathered), m.layers - 1
    kinds, alives, before = _per_kind(m, wl, lay, feats, tokens)
    e, h = wl.elt, m.hidden

    def at(k: int, moment: str) -> Moment:  # k layers already done
        alive = alives[kinds[last - k]]
        # offloaded layer inputs: only the next one, prefetched, is back on the device
        ahead = (alive.ahead * min(1, last - k) * feats.offload_prefetch if feats.offload_activations
                 else before[last - k])
        a = (alive.current + ahead + alive.ahead_full + alive.kept_attn * (last - k)) * tokens
        rs, done = (g.in_flight if k > 0 else 0), g.head + k * g.per_layer
        # FSDP2: this layer gathered and the next one prefetched (the first layer, k == last, has none)
        layers = gathered + (g.prefetch if k < last else 0) + rs
        if moment == "attention":
            post = _mixer_grads(m, g.post_attn, kinds[last - k], e * (not wl.lora))
            return Moment(a - alive.attn_freed * tokens, done + post, alive.attn_temp * tokens, layers)
        if moment == "recompute":  # the mixer's forward peak in the recompute, before any of the layer's gradients
            return Moment(a - alive.attn_freed * tokens, done, (e * h + alive.fwd_temp) * tokens, layers)
        if moment == "qkv":
            temp, tile, grads, freed = alive.qkv
            return Moment(a - freed * tokens, done + g.post_attn + grads, temp * tokens + tile, layers)
        if moment == "norm":  # the whole layer's gradients exist (FSDP: unsharded, before its reduce-scatter)
            return Moment((alive.norm + ahead + alive.kept_attn * (last - k)) * tokens,
                          done + (g.in_flight or g.per_layer),
                          NORM_BACKWARD_TEMP * h * tokens, gathered + rs)
        return Moment(a + alive.mlp_bytes, done + g.down, e * h * tokens + alive.mlp_temp_bytes, layers)

    ks, mlp_ks, mixer_ks, norm_ks = _moment_layers(m, wl, kinds, alives)
    mlps = [at(k, "mlp") for k in mlp_ks]  # (none: Mamba's blocks hold no MLP)
    # the first piece's moment, measured on SP 1 rows without FSDP nor head chunks (there it is the peak; elsewhere
    # the measured peaks lie elsewhere and the same count would be 2-5% over them)
    qkv = ([at(k, "qkv") for k in ks] if alives[kinds[0]].qkv and lay.sp == 1 and not feats.fsdp
           and feats.attention_head_chunks == 1 else [])
    rec = [at(k, "recompute") for k in ks if alives[kinds[last - k]].fwd_temp]
    mixer = max([*(at(k, "attention") for k in mixer_ks), *(at(k, "norm") for k in norm_ks), *qkv, *rec],
                key=_total)
    return (max(mlps, key=_total) if mlps else mixer), mixer


def _moment_layers(m: ModelFacts, wl: Workload, kinds: list[str],
                   alives: dict[str, _Alive]) -> tuple[set[int], list[int], list[int], list[int]]:
    """Which layers (by how many are done) to look at for each moment: a dense model's moments peak at its first,
    second, second-to-last or last layer; a hybrid's at any layer. (all, MLP moments, mixer moments, input-norm
    moments): a block decoder's mixer blocks have no MLP moment, its MLP blocks no mixer moment."""
    last = m.layers - 1
    ks = {0, min(1, last), max(0, last - 1), last} if not m.linear_layers and not m.blocks else set(range(m.layers))
    mlp_ks = [k for k in ks if _has_mlp(m, kinds[last - k])]
    mixer_ks = [k for k in ks if kinds[last - k] != "mlp"]
    norm_ks = [k for k in ks if (k < last or not wl.lora) and alives[kinds[last - k]].norm]
    return ks, mlp_ks, mixer_ks, norm_ks


def _has_mlp(m: ModelFacts, kind: str) -> bool:
    """Whether a layer of this kind holds an MLP (every layer but a block decoder's mixer blocks and planner.families'
    layers without one: Mamba's, Zamba2's Mamba2 blocks)."""
    if m.family is not None:
        return family_mlp_kind(m, kind) != "none"
    return not m.blocks or kind == "mlp"


def _total(x: Moment) -> int:
    return x.total


def _per_kind(m: ModelFacts, wl: Workload, lay: Layout, feats: Features,
              tokens: int) -> tuple[list[str], dict[str, _Alive], list[int]]:
    """Each layer's kind, what a layer of each kind holds in its backward, and before[i]: what the layers below
    layer i keep until their own backward (their inputs with checkpointing, else their saved tensors)."""
    kinds = _kinds_by_layer(m)
    alives = {kd: _alive(m, wl, lay, feats, tokens, kd) for kd in set(kinds)}
    if feats.keep_attention and feats.activation_checkpointing:
        kept = kept_attention_bytes(m, wl.elt, lay.ulysses, lay.ring, wl.seq_len)
        alives = {kd: replace(a, kept_attn=kept) for kd, a in alives.items()}
    before = [0]
    for kd in kinds:
        before.append(before[-1] + alives[kd].ahead)
    return kinds, alives, before


def _kinds_by_layer(m: ModelFacts) -> list[str]:
    """Each layer's kind for `_alive`: "mean" for every layer of a dense model; a hybrid's "attention" or
    "recurrent" (a block decoder's: or "mlp")."""
    if not m.linear_layers and not m.blocks:
        return ["mean"] * m.layers
    return [m.block_kind(i) for i in range(m.layers)]


def _mixer_grads(m: ModelFacts, post_attn: int, kind: str, e: int) -> int:
    """Parameter gradients formed by a layer's mixer backward (e: 0 under LoRA): o_proj's (a recurrent layer's
    out_proj reads its value width, not q's), the post-attention norm's and the MLP's; a block decoder's mixer
    block: its out_proj / o_proj only."""
    out = _out_width(m, kind) * m.hidden * e
    return out if m.blocks else post_attn + out - m.q_dim * m.hidden * e


def _out_width(m: ModelFacts, kind: str) -> int:
    return m.recurrent.value_width if kind == "recurrent" and m.recurrent is not None else m.q_dim


# HF's RMSNorm backward (fp32 internals): the gradients through x * rsqrt, mean and pow (x, 2x, their product)
NORM_BACKWARD_TEMP = 5 * 4


def input_norm_moment(m: ModelFacts, wl: Workload, u: int, ring: int = 1, kind: str = "mean") -> int:
    """Activations per local token when a checkpointed, untiled layer's input norm runs its backward (the
    largest moment of bf16 and LoRA layers, measured): attention's and the input norm's recompute (its fp32
    input: the layer's kept input in fp32, a copy in bf16), the post-attention norm's fp32 input (in bf16
    beside the residual stream itself) and the adapters' inputs stay alive until the layer's input gradient
    is formed."""
    if m.blocks:  # a block's norm and its mixer's (or MLP's) recompute; no post-attention norm
        return layer_bytes_per_token(m, wl, u, False, ring, kind)
    e, h, full = wl.elt, m.hidden, not wl.lora
    qkv = any(wl.trains(t) for t in ("q_proj", "k_proj", "v_proj"))
    post = 4 * h + (e * h if e == 2 else 0)
    return norm_bytes(m, e, True, full, qkv) + attention_bytes(m, wl, u, ring, kind) + post + lora_bytes(m, wl)

