"""The layer structure of the hybrid families whose layers are not "one mixer + one MLP" of a single recurrent kind
beside softmax attention (what planner.model models on its own): LFM2 / LFM2-MoE / LFM3 (short convs), Jamba
(Mamba1 + attention, MoE every few layers), Falcon-Mamba / Mamba (Mamba1 blocks only), Falcon-H1 (Mamba2 in parallel
with attention in every layer), Zamba2 (Mamba2 blocks; its hybrid layers add a shared attention block),
OLMo-hybrid (Gated DeltaNet), Kimi-Linear (KDA + MLA, MoE after the dense layers), MiniMax (lightning attention,
MoE in every layer), RecurrentGemma (RG-LRU blocks and local attention from block_types; an MLP of
intermediate_size / 2 with biases, o_proj's bias).

Each layer becomes a LayerShape: its label (printed by `seqpar plan`), its parameter tensors as transformers 5.24
builds them (read from the transformers config object, so derived fields such as Jamba's layers_block_type or
Kimi-Linear's mlp_layer_types are transformers' own), what it holds (a recurrent mixer, softmax attention, a dense
or MoE MLP) and the weights one token multiplies. Zamba2's shared blocks are counted once for parameters
(`shared`), and per use (every hybrid layer) for activations and FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SeqParError
from .moe import MoeFacts
from .recurrent import RecurrentFacts

__all__ = ["FAMILY_TYPES", "LayerShape", "FamilyFacts", "family_facts"]

FAMILY_TYPES = ("lfm2", "lfm2_moe", "lfm3", "jamba", "falcon_mamba", "mamba", "falcon_h1", "zamba2", "olmo_hybrid",
                "kimi_linear", "minimax", "recurrent_gemma")


@dataclass(frozen=True)
class LayerShape:
    label: str  # e.g. "mamba1 + moe", "attention + mlp"
    tensors: tuple[int, ...]  # its own parameters' element counts (a shared block's not included)
    active: int  # weights one token multiplies by in this layer (MoE: top-k experts; a shared block's included)
    recurrent: bool  # holds the family's recurrent mixer
    attention: bool  # holds softmax attention (Falcon-H1: beside the mixer; Zamba2: a use of a shared block)
    mlp: str  # "dense", "moe" or "none"
    norms: int | None = None  # RMSNorms of the layer (None: its hidden-sized tensors, which are its norms)


@dataclass(frozen=True)
class FamilyFacts:
    layers: tuple[LayerShape, ...]
    shared: tuple[int, ...] = ()  # parameters every use shares (Zamba2's shared transformer blocks), counted once
    moe: MoeFacts | None = None  # the MoE MLP of the layers whose mlp is "moe"
    dense_intermediate: int = 0  # the dense MLP's intermediate size

    def kinds(self) -> dict[str, int]:
        """Layers per label, in order of first appearance."""
        out: dict[str, int] = {}
        for lay in self.layers:
            out[lay.label] = out.get(lay.label, 0) + 1
        return out


def _get(hf: Any, name: str, default: Any = None) -> Any:
    v = getattr(hf, name, None)
    return default if v is None else v


def _qkvo(h: int, heads: int, kv: int, d: int, bias: bool = False) -> list[int]:
    t = [h * heads * d, h * kv * d, h * kv * d, heads * d * h]
    return t + ([heads * d, kv * d, kv * d] if bias else [])


def _dense(h: int, i: int, bias: bool = False) -> list[int]:
    return [h * i, h * i, i * h] + ([i, i, h] if bias else [])


def _lfm2_intermediate(hf: Any) -> int:
    """Lfm2MLP's width: auto-adjusted (2/3, times the multiplier, rounded up to multiple_of) when asked."""
    i = int(hf.intermediate_size)
    if _get(hf, "block_auto_adjust_ff_dim", False):
        i = int(2 * i / 3)
        if _get(hf, "block_ffn_dim_multiplier") is not None:
            i = int(hf.block_ffn_dim_multiplier * i)
            m = int(hf.block_multiple_of)
            i = m * ((i + m - 1) // m)
    return i


def _moe(hf: Any, experts: int, shared: int) -> MoeFacts:
    top = int(_get(hf, "num_experts_per_tok", None) or _get(hf, "num_experts_per_token", 1))
    i = int(_get(hf, "moe_intermediate_size", None) or hf.intermediate_size)
    return MoeFacts(experts=experts, top_k=top, intermediate=i, shared_intermediate=shared, shared_gate=False)


def _mla(hf: Any, h: int) -> list[int]:
    heads, r, rope = int(hf.num_attention_heads), int(hf.kv_lora_rank), int(hf.qk_rope_head_dim)
    nope, v = int(hf.qk_nope_head_dim), int(hf.v_head_dim)
    qr = _get(hf, "q_lora_rank")
    q = [h * qr, qr, qr * heads * (nope + rope)] if qr else [h * heads * (nope + rope)]
    return [*q, h * (r + rope), r, r * heads * (nope + v), heads * v * h]


def _layer(label: str, tensors: list[int], mlp: list[int], moe: MoeFacts | None, h: int, recurrent: bool,
           attention: bool, kind: str, shared_active: int = 0, norms: int | None = None) -> LayerShape:
    t = tuple(tensors + mlp)
    active = sum(t) + shared_active
    if kind == "moe":
        assert moe is not None
        active = sum(tensors) + moe.active_params(h) + shared_active
    return LayerShape(label, t, active, recurrent, attention, kind, norms)


def family_facts(model_type: str, hf: Any, rec: RecurrentFacts | None) -> FamilyFacts:
    """A family's layers from its transformers config object (`rec`: its recurrent mixer)."""
    h = int(hf.hidden_size)
    heads = int(_get(hf, "num_attention_heads", 1))  # (Mamba / Falcon-Mamba: no attention)
    kv = int(_get(hf, "num_key_value_heads", heads))
    d = int(_get(hf, "head_dim", h // heads))
    n = int(hf.num_hidden_layers)
    mix = rec.mixer_tensors(h) if rec is not None else []
    name = rec.kind if rec is not None else ""
    if model_type in ("falcon_mamba", "mamba"):  # norm + mixer blocks
        return FamilyFacts(tuple(_layer(name, [*mix, h], [], None, h, True, False, "none") for _ in range(n)))
    if model_type == "zamba2":
        return _zamba2(hf, mix, h, n)
    types = [str(t) for t in (_get(hf, "layer_types") or _get(hf, "layers_block_type") or [])]
    moe, moe_layers, dense_i = None, [False] * n, int(hf.intermediate_size)
    if model_type == "jamba":
        experts = [int(e) for e in hf.layers_num_experts]
        moe = _moe(hf, max(experts), 0) if max(experts) > 1 else None
        moe_layers = [e > 1 for e in experts]
    elif model_type == "lfm2_moe":
        moe = _moe(hf, int(hf.num_experts), 0)
        moe_layers = [i >= int(hf.num_dense_layers) for i in range(n)]
    elif model_type == "kimi_linear":
        shared = int(_get(hf, "num_shared_experts", 0)) * int(hf.moe_intermediate_size)
        moe = _moe(hf, int(hf.num_experts), shared)
        moe_layers = [t == "sparse" for t in hf.mlp_layer_types]
    elif model_type == "minimax":
        moe, moe_layers = _moe(hf, int(hf.num_local_experts), 0), [True] * n
    elif model_type in ("lfm2", "lfm3"):
        dense_i = _lfm2_intermediate(hf)
    elif model_type == "recurrent_gemma":  # RecurrentGemmaMlp: intermediate_size // 2 wide
        dense_i = int(hf.intermediate_size) // 2
    norms = 4 if model_type == "lfm3" else 2
    biased = model_type == "recurrent_gemma"  # its MLP's projections (and its attention's o_proj) have biases
    layers = []
    for i, t in enumerate(types):
        recurrent = t not in ("full_attention", "attention", "sliding_attention")
        mixer = mix if recurrent else _attention(model_type, hf, h, heads, kv, d)
        label = name if recurrent else "mla attention" if model_type == "kimi_linear" else "attention"
        if model_type == "falcon_h1":  # Mamba2 beside attention in every layer
            recurrent, mixer, label = True, mix + _attention(model_type, hf, h, heads, kv, d), "mamba2 + attention"
        kind = "moe" if moe_layers[i] else "dense"
        mlp = (moe.tensors(h) if moe is not None and kind == "moe" else _dense(h, dense_i, biased))
        layers.append(_layer(f"{label} + {kind}", [*mixer, *[h] * norms], mlp, moe, h, recurrent,
                             not recurrent or model_type == "falcon_h1", kind, norms=norms if biased else None))
    if len(layers) != n:
        raise SeqParError(f"model type {model_type!r}: {len(layers)} layer types for {n} layers: give a config "
                          "whose layer_types list has one entry per layer")
    return FamilyFacts(tuple(layers), moe=moe, dense_intermediate=dense_i)


def _attention(model_type: str, hf: Any, h: int, heads: int, kv: int, d: int) -> list[int]:
    """A softmax attention layer's tensors in this family."""
    if model_type == "kimi_linear":
        return _mla(hf, h)
    bias = bool(_get(hf, "attention_bias", False))
    t = _qkvo(h, heads, kv, d, bias)
    if model_type in ("lfm2", "lfm2_moe"):  # q / k layernorms per head
        return t + [d, d]
    if model_type == "lfm3":  # q / k norms per head, an output gate per head (g_proj)
        return t + [d, d, h * heads]
    if model_type == "olmo_hybrid":  # q / k norms over all heads
        return t + [heads * d, kv * d]
    if model_type == "recurrent_gemma":  # o_proj always has a bias
        return t + [h]
    return t


def _zamba2(hf: Any, mix: list[int], h: int, n: int) -> FamilyFacts:
    """Mamba2 blocks (norm + mixer); a hybrid layer adds its `linear` (h x h) and runs one of num_mem_blocks shared
    transformer blocks (attention over [x, embeddings]: 2h wide, an MLP) with this use's LoRA-like adapters."""
    a, heads, kv, d = int(hf.attention_hidden_size), int(hf.num_attention_heads), int(hf.num_key_value_heads), int(
        hf.attention_head_dim)
    i, r = int(hf.intermediate_size), int(hf.adapter_rank)
    block = [a * heads * d, a * kv * d, a * kv * d, heads * d * h, a, h, h * 2 * i, i * h]
    adapters = ([2 * a * r] * 3 if _get(hf, "use_shared_attention_adapter", False) else []) + [h * r + r * 2 * i]
    types = [str(t) for t in hf.layers_block_type]
    layers = []
    for t in types:
        if t == "hybrid":
            layers.append(_layer("mamba2 + shared attention block", [*mix, h, h * h, *adapters], [], None, h, True,
                                 True, "dense", shared_active=sum(block)))
        else:
            layers.append(_layer("mamba2", [*mix, h], [], None, h, True, False, "none"))
    shared = tuple(int(hf.num_mem_blocks) * block)
    return FamilyFacts(tuple(layers), shared=shared, dense_intermediate=i)
