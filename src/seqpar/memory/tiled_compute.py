"""Tiled decoder layer (ALST's SequenceTiledCompute, for the whole layer but attention itself).

    apply_tiled_layer(model, True)   # tile count from the shapes: ceil(S_local / hidden_size), at least 1
    apply_tiled_layer(model, 4)      # 4 tiles

A pre-norm decoder layer (llama, qwen2, qwen3 with q_norm / k_norm, mistral) runs as three pieces:
1. `SequenceTiled` over sequence tiles: input RMSNorm, q/k/v projections, q_norm / k_norm, RoPE -> q, k, v.
   Saved for backward: its inputs only (the layer input, cos / sin), so no full-length norm output, fp32
   norm intermediates or pre-RoPE projections exist;
2. the model's own attention function (seqpar's SP attention) on the full local q, k, v;
3. `SequenceTiled`: o_proj, the residual add, the post-attention RMSNorm, the MLP and the second residual
   add. Saved: the attention output and the layer input; the middle residual stream, the norm output and
   the MLP intermediates exist one tile at a time.
Forward runs the tiles without autograd; backward recomputes one tile at a time, writes the tile's input
gradients into one full-length buffer per input (no per-tile gradient copies, no concatenation) and sums the
parameter gradients over the tiles, returned as the node's own (each parameter is accumulated once per
backward, as untiled: DDP's readiness hooks and FSDP2's gradient hooks see the usual graph).

Exact: every op outside attention is per token, so tiling only reorders independent rows (matmuls over
fewer rows may round differently in the last bit: ~1e-7 relative). The attention function gets the same
arguments (layouts and strides included) as the model's own attention forward. LoRA-wrapped projections
and FSDP2 work (the projections are called as modules inside the tiles; FSDP2 gathers per decoder layer,
outside the tiles). No collective runs per tile, so tile counts may differ between ranks.
DeepSpeed ZeRO-3 (gathers and releases parameters per module call, inside the tiles) is refused by the
Trainer drop-ins; `same_tile_count` would still agree counts for these layers (they are `TiledForward`s).

The override is instance-level (`layer.forward`): no module is replaced, state_dict keys are unchanged.
transformers' GradientCheckpointingLayer wraps the CLASS forward, so the override re-does that wrapper
(the layer's own `_gradient_checkpointing_func`, whatever checkpointing / offload installed). With a KV
cache (generation, or `use_cache=True` forwards) the tiles' k, v update the cache as in the model's forward.
Other layer structures (gemma2/3's extra norms, phi3's fused qkv, unknown archs) raise a SeqParError.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch

from ..errors import SeqParError
from ..unwrap import decoder_layers
from .tiled_mlp import TiledForward, tile_count_arg

__all__ = ["apply_tiled_layer", "remove_tiled_layer", "tiled_layers", "TiledLayerForward", "final_norms"]

_REFUSE = "set memory.tiled_layer: false (or tiled_layer=False for the Trainer drop-ins)"
# attention class -> how its forward passes sliding_window to the attention function (None: it does not)
_ATTN = {"LlamaAttention": None, "Qwen2Attention": "self", "Qwen3Attention": "self", "MistralAttention": "config"}
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_CACHE_ARGS = ("cache", "past_key_values")  # the KV cache argument: transformers >= 5.24 / before


def _check_layer(layer: torch.nn.Module) -> None:
    attn = getattr(layer, "self_attn", None)
    kind = type(attn).__name__
    children = {n for n, _ in layer.named_children()}
    ok = (kind in _ATTN and children == _LAYER_CHILDREN
          and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")))
    if ok and kind == "Qwen3Attention":
        ok = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    if not ok:
        raise SeqParError(
            f"tiled layer cannot tile {type(layer).__name__} (attention {kind}, children {sorted(children)}): it "
            f"supports the pre-norm llama / qwen2 / qwen3 / mistral layers: {_REFUSE}")


def tiled_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every decoder layer of `model`; SeqParError if one is not a layer seqpar can tile."""
    layers = decoder_layers(model)
    if not layers:
        raise SeqParError(f"{type(model).__name__} has no decoder layers seqpar recognises: {_REFUSE}")
    for layer in layers:
        _check_layer(layer)
    return layers


def _attention_inputs(layer: torch.nn.Module, rope: Any, x: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile: RMSNorm -> q/k/v (-> q_norm/k_norm) -> RoPE, in the [B, s, heads, head_dim] layout."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q, k, v = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape), attn.v_proj(h).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(q, k, cos, sin, unsqueeze_dim=2)
    # q, k leave as [B, heads, s, d] (contiguous after the concat, as in the model's forward); v as it is
    return q.transpose(1, 2), k.transpose(1, 2), v


def _block_output(layer: torch.nn.Module, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One tile: o_proj, residual, post-attention RMSNorm, MLP, residual (the model's op order)."""
    h = x + layer.self_attn.o_proj(a)
    return h + layer.mlp(layer.post_attention_layernorm(h))


class TiledLayerForward(TiledForward):
    """The instance-level forward of a tiled decoder layer: `tiles` = int, or None for auto_tile_count."""

    def __init__(self, layer: torch.nn.Module, tiles: int | None) -> None:
        super().__init__(layer.forward, tiles)
        self.layer = layer
        mod = sys.modules[type(layer.self_attn).__module__]
        self.rope = mod.apply_rotary_pos_emb
        self.eager = mod.eager_attention_forward
        self.window = _ATTN[type(layer.self_attn).__name__]

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        layer = self.layer
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            # what GradientCheckpointingLayer's class-level wrapper does (it is bypassed by this override)
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            for name in _CACHE_ARGS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
            return layer._gradient_checkpointing_func(partial(self.tiled, **kwargs), *args)
        return self.tiled(*args, **kwargs)

    def _run(self, fn: Any, n: int, dims: tuple[int, ...], inputs: tuple[torch.Tensor, ...],
             modules: tuple[torch.nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        if not torch.is_grad_enabled():
            return _tiles_no_grad(fn, n, dims, inputs)
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        return SequenceTiled.apply(fn, n, dims, len(inputs), *inputs, *params)

    def tiled(self, hidden_states: torch.Tensor, attention_mask: Any = None, position_ids: Any = None,
              past_key_values: Any = None, use_cache: bool | None = False,
              position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache: Any = None,
              **kwargs: Any) -> torch.Tensor:
        layer, attn, x = self.layer, self.layer.self_attn, hidden_states
        n = self.count(x)
        cos, sin = position_embeddings
        pre = (layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, *_qk_norms(attn))
        q, k, v = self._run(partial(_attention_inputs, layer, self.rope), n, (2, 2, 1), (x, cos, sin), pre)
        v = v.transpose(1, 2)
        # as the model's attention forward does (generation, use_cache=True). transformers >= 5.24 names the
        # cache `cache` (and hands the layer's kwargs to its update); before, `past_key_values`
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        elif past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
        iface = _attention_interface(attn, self.eager)
        extra = {} if self.window is None else {"sliding_window": (
            attn.sliding_window if self.window == "self" else getattr(attn.config, "sliding_window", None))}
        out, _ = iface(attn, q, k, v, attention_mask, dropout=0.0 if not attn.training else attn.attention_dropout,
                       scaling=attn.scaling, position_ids=position_ids, use_cache=use_cache, **extra, **kwargs)
        del q, k, v
        a = out.reshape(*x.shape[:-1], -1).contiguous()
        del out
        post = (attn.o_proj, layer.post_attention_layernorm, layer.mlp)
        return self._run(partial(_block_output, layer), n, (1,), (a, x), post)[0]


def _qk_norms(attn: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else ()


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _tiles_no_grad(fn: Any, n: int, dims: tuple[int, ...], inputs: tuple[torch.Tensor, ...]) -> tuple:
    outs = [_as_tuple(fn(*p)) for p in zip(*(t.tensor_split(n, dim=1) for t in inputs))]
    return tuple(torch.cat([o[i] for o in outs], dim=d) for i, d in enumerate(dims))


class SequenceTiled(torch.autograd.Function):
    """fn over n sequence tiles (dim 1 of every input); saved for backward: the inputs only.

    apply(fn, n, dims, n_inputs, *inputs, *params): output i is the tiles' output i concatenated along dims[i].
    Backward recomputes one tile at a time, takes that tile's input and parameter gradients with
    torch.autograd.grad, writes the input gradients into one full-length buffer per input and sums the
    parameter gradients, which it returns as this node's: autograd accumulates each parameter once per
    backward, as for an untiled layer (DDP's once-per-parameter readiness, FSDP2's hooks see the usual graph).
    """

    @staticmethod
    def forward(ctx: Any, fn: Any, n: int, dims: tuple[int, ...], n_inputs: int, *tensors: torch.Tensor) -> Any:
        inputs = tensors[:n_inputs]
        ctx.fn, ctx.n, ctx.dims, ctx.n_inputs = fn, n, dims, n_inputs
        ctx.save_for_backward(*tensors)
        with torch.no_grad():  # detached: module hooks (MemTracker's) see no grad-requiring tile views here
            return _tiles_no_grad(fn, n, dims, tuple(t.detach() for t in inputs))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        saved = ctx.saved_tensors
        inputs, params = saved[:ctx.n_inputs], saved[ctx.n_inputs:]
        needs = ctx.needs_input_grad[4:4 + ctx.n_inputs]
        in_grads = [torch.zeros_like(t) if need else None for t, need in zip(inputs, needs)]
        p_grads: list[torch.Tensor | None] = [None] * len(params)
        parts = [t.tensor_split(ctx.n, dim=1) for t in inputs]
        g_parts = [g.tensor_split(ctx.n, dim=d) if g is not None else None for g, d in zip(grads, ctx.dims)]
        for i in range(ctx.n):
            with torch.enable_grad():
                tin = [p[i].detach().requires_grad_(need) for p, need in zip(parts, needs)]
                outs = _as_tuple(ctx.fn(*tin))
            pairs = [(o, g[i]) for o, g in zip(outs, g_parts) if g is not None and o.requires_grad]
            wrt = [t for t in tin if t.requires_grad] + list(params)
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
            k = 0
            for j, t in enumerate(tin):
                if t.requires_grad:
                    if got[k] is not None:
                        in_grads[j].tensor_split(ctx.n, dim=1)[i].copy_(got[k])
                    k += 1
            for j, g in enumerate(got[k:]):  # summed in fp32: bf16 tiles round once, as one untiled matmul
                if g is not None:
                    p_grads[j] = g.float() if p_grads[j] is None else p_grads[j].add_(g)
            del outs, pairs, got
        p_grads = [g if g is None else g.to(p.dtype) for g, p in zip(p_grads, params)]
        return (None, None, None, None, *in_grads, *p_grads)


def _attention_interface(attn: torch.nn.Module, eager: Any) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)


def apply_tiled_layer(model: torch.nn.Module, tiles: bool | int = True) -> int:
    """Tile every decoder layer of `model` (PEFT wrappers fine; before FSDP2), and the final norm after them (HF's
    RMSNorm backward makes fp32 [S_local, hidden] temporaries: at long lengths the largest moment once the layers
    are tiled). Returns the number of layers.

    tiles: True = auto (ceil(S_local / hidden_size) per forward), an int >= 1 = that many tiles. Applying
    again changes the tile count.
    """
    n = tile_count_arg(tiles, "tiled layer", "apply_tiled_layer", "remove_tiled_layer")
    layers = tiled_layers(model)  # every check before any change
    for layer in layers:
        cur = layer.__dict__.get("forward")
        if isinstance(cur, TiledLayerForward):
            cur.tiles = n
        else:
            layer.forward = TiledLayerForward(layer, n)
    for norm in final_norms(model):
        cur = norm.__dict__.get("forward")
        if isinstance(cur, TiledForward):
            cur.tiles = n
        else:
            norm.forward = TiledForward(norm.forward, n)
    return len(layers)


def final_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The norm each decoder stack applies after its layers (`norm` beside a `layers` list of decoder layers)."""
    out = []
    for m in model.modules():
        layers, norm = getattr(m, "layers", None), getattr(m, "norm", None)
        if isinstance(layers, torch.nn.ModuleList) and isinstance(norm, torch.nn.Module) and any(
                type(x).__name__.endswith("DecoderLayer") for x in layers):
            out.append(norm)
    return out


def remove_tiled_layer(model: torch.nn.Module) -> None:
    for m in decoder_layers(model):
        if isinstance(m.__dict__.get("forward"), TiledLayerForward):
            del m.forward
    for norm in final_norms(model):
        if isinstance(norm.__dict__.get("forward"), TiledForward):
            del norm.forward
