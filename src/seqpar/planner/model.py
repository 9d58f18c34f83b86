"""Architecture facts of a decoder-only causal LM, from its HF config alone (no weights, no hub).

Sources: a local model directory or config.json, a bundled name (planner/configs/*.json: published
config.json numbers of well-known models, and `smollm2`), or `tiny:<arch>` (seqpar.hf.tiny_config).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..errors import SeqParError
from ..textfiles import read_json
from .families import FAMILY_TYPES, FamilyFacts
from .mla import MlaFacts, mla_fields
from .moe import MoeFacts, moe_facts
from .recurrent import RECURRENT_KINDS, RecurrentFacts, layer_kinds, recurrent_facts
from .refusals import refuse_unmodelled
from .spans import Span, layer_spans, span_groups

__all__ = ["ModelFacts", "load_model_facts", "bundled_models"]

# Architectures whose attention normalises q and k per head (RMSNorm over head_dim) before RoPE.
QK_NORM_TYPES = ("qwen3", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "lfm2_moe", "lfm3", "olmo_hybrid")
# Gated attention (Qwen3.5 / Qwen3-Next): q_proj also produces a per-channel output gate (twice q's width).
GATED_ATTENTION_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# Architectures whose attention has no rotary embedding (no cos / sin tensors): Nemotron-H's.
NO_ROPE_TYPES = ("nemotron_h",)
# Architectures whose attention layers hold learned sinks (one logit per q head; seqpar.train.model.checks).
SINK_TYPES = ("gpt_oss",)
# Config fields of a final-logit softcap (RecurrentGemma names it logits_soft_cap).
SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap")
# Architectures with a bias on the q/k/v projections.
QKV_BIAS_TYPES = ("qwen2",)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int | None = None
    qk_norm: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None  # the window of the model's sliding-attention layers (None: none)
    recurrent: RecurrentFacts | None = None  # hybrids: the recurrent mixer of `linear_layers` of the layers
    linear_index: tuple[int, ...] = ()  # which layers are recurrent (their order sets the backward's moments)
    gated_attention: bool = False  # q_proj also gives attention's output gate (GATED_ATTENTION_TYPES)
    mlp_index: tuple[int, ...] = ()  # block-per-mixer decoders (Nemotron-H): the blocks that hold only a dense MLP
    rope: bool = True  # attention applies RoPE (Nemotron-H's does not: no cos / sin tensors)
    moe: MoeFacts | None = None  # every layer's MLP is this mixture of experts (Qwen3-Next, Qwen3.5-MoE)
    spans: tuple[Span, ...] = ()  # each layer's attention span (planner.spans; empty: every layer attends in full)
    v_head_dim: int | None = None  # v's head dim where it differs from q / k's (MLA); None: head_dim
    mla: MlaFacts | None = None  # multi-head latent attention's projections
    sinks: bool = False  # gpt-oss: one learned sink logit per q head in every attention layer
    family: FamilyFacts | None = None  # planner.families: each layer's shape (LFM2, Jamba, Falcon-H1, Zamba2 ...)
    logit_softcap: bool = False  # tanh(logits / cap) * cap after lm_head (Gemma 2, RecurrentGemma): its tanh is kept

    @property
    def v_head(self) -> int:
        """v's (and the attention output's) head dim before any padding."""
        return self.v_head_dim or self.head_dim

    @property
    def o_dim(self) -> int:
        """o_proj's input width: the attention output in sequence space (MLA: heads x v_head_dim)."""
        return self.heads * self.v_head

    def attention_spans(self) -> dict[Span, int]:
        """Attention layers per span (planner.spans): e.g. {full: 10, sliding window 1024: 52}."""
        return dict(span_groups(self.spans, self.softmax_index))

    @property
    def softmax_index(self) -> list[int]:
        """The layers that run softmax attention (Falcon-H1's beside their mixer, Zamba2's shared block's uses)."""
        if self.family is not None:
            return [i for i, lay in enumerate(self.family.layers) if lay.attention]
        return [i for i in range(self.layers) if self.block_kind(i) == "attention"]

    @property
    def softmax_layers(self) -> int:
        return len(self.softmax_index)

    @property
    def blocks(self) -> bool:
        """A decoder of blocks holding one mixer or one MLP each (Nemotron-H), not a mixer and an MLP per layer."""
        return bool(self.mlp_index)

    @property
    def linear_layers(self) -> int:
        """How many layers (blocks) are recurrent."""
        return len(self.linear_index)

    @property
    def attn_layers(self) -> int:
        """Layers (blocks) whose mixer is softmax attention (all of them but a hybrid's recurrent ones and a
        block decoder's MLP blocks)."""
        return self.layers - self.linear_layers - len(self.mlp_index)

    def block_kind(self, i: int) -> str:
        """Layer i's kind: "recurrent", "attention" or (block decoders) "mlp"."""
        return "recurrent" if self.is_recurrent(i) else "mlp" if i in self.mlp_index else "attention"

    def is_recurrent(self, i: int) -> bool:
        """Whether layer i's mixer is a recurrent one (a hybrid's Gated DeltaNet / Mamba2 layer)."""
        return i in self.linear_index

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def _attention_tensors(self) -> list[int]:
        """q k v o (MLA: its low-rank projections and their norms; gpt-oss: + one sink per q head)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        sinks = [self.heads] if self.sinks else []
        if self.mla is not None:
            a = self.mla
            qp = [h * a.q_lora_rank, a.q_lora_rank, a.q_lora_rank * q] if a.q_lora_rank else [h * q]
            nope = self.head_dim - a.rope_dim
            return [*qp, h * (a.kv_lora_rank + a.rope_dim), a.kv_lora_rank,
                    a.kv_lora_rank * self.heads * (nope + self.v_head), self.o_dim * h, *sinks]
        gq = 2 * q if self.gated_attention else q
        return [h * gq, h * kv, h * kv, q * h, *sinks]

    def _layer_tensors(self) -> list[int]:
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        if self.blocks:  # an attention block: q k v o and its norm
            return [*self._attention_tensors(), h]
        t = [*self._attention_tensors(), *self._mlp_tensors(), h, h]  # q k v o, the MLP, two norms
        if self.qkv_bias and self.mla is not None:  # MLA's bias: on q_a (or q_proj) and kv_a
            t += [self.mla.q_lora_rank or q, self.mla.kv_lora_rank + self.mla.rope_dim]
        elif self.qkv_bias:
            t += [q, kv, kv]
        if self.qk_norm:
            t += [self.head_dim, self.head_dim]
        return t

    def _mlp_tensors(self) -> list[int]:
        """A layer's MLP: gate up down, or the MoE block's tensors (planner.moe)."""
        h, i = self.hidden, self.intermediate
        return self.moe.tensors(h) if self.moe else [h * i, h * i, i * h]

    def mlp_params(self) -> int:
        """Parameters of one layer's MLP (a mixture of experts: every expert's, the router's, the shared one's)."""
        return sum(self._mlp_tensors())

    def active_layer_params(self) -> int:
        """Weights a token multiplies by in one layer: all of them, but only the top-k experts of an MoE MLP."""
        if self.family is not None:
            return sum(lay.active for lay in self.family.layers) // self.layers
        if self.moe is None:
            return self.layer_params()
        return self.layer_params() - self.mlp_params() + self.moe.active_params(self.hidden)

    def _mlp_block_tensors(self) -> list[int]:
        """A block decoder's MLP block: up and down (Nemotron-H's relu2 MLP has no gate) and its norm."""
        h, i = self.hidden, self.intermediate
        return [h * i, i * h, h]

    def _recurrent_layer_tensors(self) -> list[int]:
        """A hybrid's recurrent layer: its mixer, the MLP (gate up down) and two norms."""
        h = self.hidden
        assert self.recurrent is not None
        if self.blocks:  # a Mamba2 block: the mixer and its norm
            return self.recurrent.mixer_tensors(h) + [h]
        return self.recurrent.mixer_tensors(h) + self._mlp_tensors() + [h, h]

    def decoder_tensors(self) -> list[int]:
        """Element counts of every decoder layer's parameters (planner.families: a shared block's once)."""
        if self.family is not None:
            return [t for lay in self.family.layers for t in lay.tensors] + list(self.family.shared)
        rec = self.linear_layers * self._recurrent_layer_tensors() if self.linear_layers else []
        return self.attn_layers * self._layer_tensors() + rec + len(self.mlp_index) * self._mlp_block_tensors()

    def block_params(self, kind: str) -> int:
        """Parameters of one layer of a kind ("attention", "recurrent", "mlp"; planner.families: the mean over the
        layers of that kind, a shared block's parameters spread over its uses)."""
        if self.family is not None:
            mine = [lay for i, lay in enumerate(self.family.layers) if self.block_kind(i) == kind]
            uses = sum(1 for lay in self.family.layers if lay.attention and lay.recurrent) or 1
            shared = sum(self.family.shared) // uses if kind == "recurrent" and self.family.shared else 0
            return sum(sum(lay.tensors) for lay in mine) // max(1, len(mine)) + shared
        t = {"attention": self._layer_tensors, "recurrent": self._recurrent_layer_tensors,
             "mlp": self._mlp_block_tensors}[kind]
        return sum(t())

    def layer_params(self) -> int:
        """Parameters of one decoder layer (a hybrid's: the average over its layer kinds)."""
        if not self.linear_layers and not self.blocks:
            return sum(self._layer_tensors())
        return sum(self.decoder_tensors()) // self.layers

    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def lm_head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def num_params(self) -> int:
        return sum(self.trainable_tensors())

    def lora_params(self, r: int, targets: tuple[str, ...]) -> int:
        """Trainable LoRA parameters (A: in x r, B: r x out) over all layers."""
        return sum(self.trainable_tensors(r, targets))

    def trainable_tensors(self, lora_r: int | None = None, targets: tuple[str, ...] = ()) -> list[int]:
        """Element counts of the trained tensors: every parameter (full fine-tuning), or each LoRA A and B."""
        if lora_r is not None:
            shapes = self._lora_shapes()
            mlp = ("gate_proj", "up_proj", "down_proj")  # a recurrent layer has these, not q / k / v / o
            attn = ("q_proj", "k_proj", "v_proj", "o_proj") if self.blocks else tuple(shapes)
            rec = () if self.blocks else mlp  # a block decoder's recurrent blocks have no MLP
            return (self.attn_layers * [lora_r * n for t in targets if t in attn for n in shapes[t]]
                    + self.linear_layers * [lora_r * n for t in targets if t in rec for n in shapes[t]]
                    + len(self.mlp_index) * [lora_r * n for t in targets if t in ("up_proj", "down_proj")
                                             for n in shapes[t]])
        head = [self.lm_head_params()] if not self.tied else []
        return [self.embed_params()] + self.decoder_tensors() + [self.hidden] + head

    def _lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every Linear a LoRA target names (MLA: its own projections, by their names)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (self.o_dim, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        if self.mla is None:
            return shapes
        a = self.mla
        del shapes["k_proj"], shapes["v_proj"]
        shapes.update(kv_a_proj_with_mqa=(h, a.kv_lora_rank + a.rope_dim),
                      kv_b_proj=(a.kv_lora_rank, self.heads * (self.head_dim - a.rope_dim + self.v_head)))
        if a.q_lora_rank:
            del shapes["q_proj"]
            shapes.update(q_a_proj=(h, a.q_lora_rank), q_b_proj=(a.q_lora_rank, q))
        return shapes


def bundled_models() -> list[str]:
    files = resources.files("seqpar.planner").joinpath("configs")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json"))


def _trainer_view(name: str, c: dict[str, Any]) -> Any:
    """What `seqpar train` refuses from the config alone, by the trainer's own check (softcapped attention,
    non-causal attention, encoder-decoders, a window or chunk it cannot read ...), raised here; returns the
    transformers config (its derived layer_types, MLA dims)."""
    from transformers import AutoConfig

    from ..train.model.checks import refuse_non_causal

    kw = {k: v for k, v in c.items() if not k.startswith("_") and k != "model_type"}
    try:
        hf = AutoConfig.for_model(str(c.get("model_type", "llama")), **kw)
    except (ValueError, KeyError) as e:
        raise SeqParError(f"model {name!r}: transformers cannot build its config ({str(e)[:100]}), so seqpar train "
                          "could not load it either: give a config.json of a causal LM transformers knows") from None
    refuse_non_causal(hf, name)
    return hf


def _attention_facts(hf: Any, layers: int) -> dict[str, Any]:
    """ModelFacts' attention fields from the transformers config: spans, the sliding window if a layer slides, MLA's
    dims (head_dim: q / k's, qk_nope + qk_rope), sinks (gpt-oss), and whether the logits are softcapped."""
    spans = layer_spans(hf, layers)
    window = next((s.size for s in spans if s.kind == "sliding"), None)
    out: dict[str, Any] = {"spans": spans if any(s.kind != "full" for s in spans) else (), "sliding_window": window,
                           "sinks": hf.model_type in SINK_TYPES or bool(getattr(hf, "use_sinks", False)),
                           "logit_softcap": any(getattr(hf, k, None) is not None for k in SOFTCAP_FIELDS)}
    return {**out, **mla_fields(hf)}


def _facts(name: str, c: dict[str, Any]) -> ModelFacts:
    refuse_unmodelled(name, c)
    c = c.get("text_config", c) if isinstance(c.get("text_config"), dict) else c
    hf = _trainer_view(name, c)
    if c.get("model_type") in FAMILY_TYPES:
        from .family_model import family_model_facts

        layers = int(getattr(hf, "num_hidden_layers", 0) or 0)
        return ModelFacts(**family_model_facts(name, c, hf, _attention_facts(hf, layers),
                                               c.get("model_type") in QK_NORM_TYPES))
    kinds = layer_kinds(c)
    rec = recurrent_facts(name, c, kinds) if "hidden_size" in c else None
    try:
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        layers = _layer_count(c, kinds)
        attn = {"head_dim": int(c.get("head_dim") or hidden // heads), **_attention_facts(hf, layers)}
        facts = ModelFacts(
            name=name, model_type=str(c.get("model_type", "llama")), hidden=hidden,
            layers=layers, heads=heads, kv_heads=kv,
            intermediate=int(c.get("shared_intermediate_size") or c["intermediate_size"]),  # Granite 4: its dense MLP
            vocab=int(c["vocab_size"]), tied=bool(c.get("tie_word_embeddings", False)),
            max_positions=c.get("max_position_embeddings"),
            qk_norm=c.get("model_type") in QK_NORM_TYPES, gated_attention=c.get("model_type") in GATED_ATTENTION_TYPES,
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") in QKV_BIAS_TYPES)),
            recurrent=rec, linear_index=tuple(i for i, t in enumerate(kinds) if t in RECURRENT_KINDS) if rec else (),
            mlp_index=tuple(i for i, t in enumerate(kinds) if t == "mlp"),
            rope=c.get("model_type") not in NO_ROPE_TYPES, moe=moe_facts(name, c), **attn,
        )
    except KeyError as e:
        raise SeqParError(
            f"model config {name!r} lacks {e.args[0]!r}: give a decoder-only causal LM config.json"
        ) from None
    if facts.heads % facts.kv_heads != 0:
        raise SeqParError(
            f"model {name!r}: num_attention_heads={facts.heads} is not a multiple of num_key_value_heads="
            f"{facts.kv_heads}, so its heads cannot be split for attention: check the config"
        )
    return facts


def _layer_count(c: dict[str, Any], kinds: list[str]) -> int:
    """num_hidden_layers; a block decoder's (Nemotron-H) is its block list's length (`kinds`), which transformers
    uses whatever num_hidden_layers says (absent from a tiny config's dict)."""
    if "mlp" in kinds or not c.get("num_hidden_layers"):
        return len(kinds) or int(c["num_hidden_layers"])
    return int(c["num_hidden_layers"])


def _tiny(name: str, kwargs: dict[str, Any] | None) -> ModelFacts:
    from ..hf import ARCHS, HYBRID_ARCHS, TINY_ARCHS, VARIANT_ARCHS, tiny_config

    arch = name.split(":", 1)[1]
    if arch not in TINY_ARCHS:  # VLMs: refused by _facts with how to plan one, as a saved config
        raise SeqParError(f"model {name!r}: unknown tiny architecture {arch!r}: use "
                          f"tiny:<{'|'.join(ARCHS + VARIANT_ARCHS + HYBRID_ARCHS)}>")
    kw = dict(kwargs or {})
    kw.setdefault("vocab_size", 259)  # the byte tokenizer seqpar train gives tiny models
    c = tiny_config(arch, **kw).to_dict()
    if arch in ARCHS:  # (a hybrid or VLM keeps its config's own type: qwen3_5 is the VL wrapper's)
        c["model_type"] = arch
    return _facts(name, c)


def load_model_facts(name: str, tiny_kwargs: dict[str, Any] | None = None) -> ModelFacts:
    """`name`: a bundled model (see bundled_models()), tiny:<arch>, a model directory or a config.json."""
    if name.startswith("tiny:"):
        return _tiny(name, tiny_kwargs)
    key = name.lower().removesuffix("-instruct").split("/")[-1]
    if key in ("smollm2-135m",):
        key = "smollm2"
    if key in bundled_models():
        path = resources.files("seqpar.planner").joinpath("configs", f"{key}.json")
        return _facts(name, json.loads(path.read_text()))
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise SeqParError(
            f"model {name!r} is neither a bundled model ({', '.join(bundled_models())}), tiny:<arch>, a model "
            f"directory with config.json nor a config.json file: pass one of those (no hub access here)"
        )
    c = read_json(path, "model config")
    if not isinstance(c, dict):
        raise SeqParError(f"model config {path}: not a JSON object of config fields: give a model's config.json")
    return _facts(name, c)


def trainable_name(name: str) -> str:
    """What `seqpar train`'s model.name should say for a planned model: a bundled shape's hub id (a local
    directory of it works too), smollm2, tiny:<arch>, or the model directory of a config.json."""
    if name.startswith("tiny:"):
        return name
    key = name.lower().removesuffix("-instruct").split("/")[-1]
    if key in ("smollm2", "smollm2-135m"):
        return "smollm2"
    if key in bundled_models() and not os.path.exists(name):
        c = json.loads(resources.files("seqpar.planner").joinpath("configs", f"{key}.json").read_text())
        return str(c.get("_name_or_path") or name)
    return os.path.dirname(os.path.abspath(name)) if os.path.isfile(name) else name
