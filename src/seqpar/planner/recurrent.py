"""Hybrid models' recurrent layers (Gated DeltaNet, Mamba2) for the planner: parameters, saved bytes, FLOPs and
the collectives of their sequence parallelism (seqpar.recurrent, seqpar.hf.linear_attention / mamba2).

Modelled: decoders whose every layer holds one mixer (softmax attention, or a recurrent one in `linear_layers`
of them) and one dense MLP: Qwen3.5 (dense), Granite 4 and Bamba with dense MLPs; and decoders of blocks that
each hold one mixer or one dense MLP (Nemotron-H without MoE blocks: planner.model's `mlp_index`). A recurrent
layer replaces attention's q/k/v/o by its own projections (`mixer_tensors`), its saved tensors by the torch path's
(planner.recurrent_memory: counted from the torch paths, validated with the meter) and its FLOPs by the
chunked recurrence's (`flops_per_token`). Under SP:
- Ulysses: one all-to-all in (the conv's channels and the gates) and one out (the recurrence's output), per
  forward pass and again in backward (`ulysses_elems`);
- ring: the conv halo, one all-gather of (K-1) tokens of the conv channels per segment (its backward a
  reduce-scatter), and the state passing: "chain" sends one fp32 state per hop along the 2R-2 hops of the
  zigzag order (its middle step stays on one rank; R-1 hops contiguous), which every rank waits for in turn (the
  hops' latency and bytes are on each rank's critical path), forward and backward; "scan" all-gathers every
  chunk's transition (M and b; its backward a reduce-scatter). A continuing piece computes dk more value
  columns (Gated DeltaNet: the transition from the identity state) or a cumulative decay (Mamba2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SeqParError
from ..mesh import RecurrentHeads
from . import recurrent_kinds as kinds
from .recurrent_kinds import NEW_KINDS

__all__ = ["RecurrentFacts", "recurrent_facts", "DELTA_CHUNK", "RECURRENT_KINDS", "PATTERN_KINDS"]

DELTA_CHUNK = 64  # transformers' torch_chunk_gated_delta_rule chunk
RECURRENT_KINDS = ("linear_attention", "mamba")  # layer kinds whose mixer is recurrent
# Nemotron-H's hybrid_override_pattern, one character a block (transformers' NemotronHConfig._pattern_to_list)
PATTERN_KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


@dataclass(frozen=True)
class RecurrentFacts:
    kind: str  # "gated_deltanet" | "mamba2"
    heads: int  # Gated DeltaNet: k heads; Mamba2: heads
    v_heads: int  # Gated DeltaNet: v heads; Mamba2: = heads
    k_dim: int  # Gated DeltaNet: k head dim; Mamba2: state size n
    v_dim: int  # Gated DeltaNet: v head dim; Mamba2: head dim p
    groups: int  # Mamba2: B / C groups (Gated DeltaNet: 1)
    conv_kernel: int
    chunk: int  # the recurrence's chunk (SSD: the config's; delta rule: 64)
    extra: int = 0  # mamba1: the dt rank (planner.recurrent_kinds)
    bias: bool = False  # short_conv: its projections' and conv's biases; mamba1: its conv's
    norms: int = 0  # mamba1's dt / B / C RMSNorms: 0 none (Mamba), 1 weightless (Falcon-Mamba), 2 weighted (Jamba)

    @property
    def new(self) -> bool:
        """A kind planner.recurrent_kinds holds the formulas of (short_conv, mamba1, kda, lightning)."""
        return self.kind in NEW_KINDS

    @property
    def has_state(self) -> bool:
        """Whether the ring passes a state (a short conv passes its halo only)."""
        return self.kind != "short_conv"

    @property
    def ulysses(self) -> RecurrentHeads:
        return RecurrentHeads(self.kind, self.heads, self.groups)

    @property
    def conv_channels(self) -> int:
        if self.new:
            return kinds.conv_channels(self)
        if self.kind == "gated_deltanet":
            return 2 * self.heads * self.k_dim + self.v_heads * self.v_dim
        return self.v_heads * self.v_dim + 2 * self.groups * self.k_dim

    @property
    def value_width(self) -> int:
        """Output channels of the recurrence (v heads x v dim)."""
        return self.v_heads * self.v_dim

    def mixer_tensors(self, hidden: int) -> list[int]:
        """Element counts of the mixer's parameters (projections, conv, per-head scalars, gated norm, out_proj)."""
        if self.new:
            return kinds.mixer_tensors(self, hidden)
        c, w = self.conv_channels, self.value_width
        if self.kind == "gated_deltanet":  # in_proj q|k|v|z and b|a, conv, dt_bias, A_log, norm (v dim), out_proj
            return [hidden * (c + w), hidden * 2 * self.v_heads, c * self.conv_kernel, self.v_heads, self.v_heads,
                    self.v_dim, w * hidden]
        return [hidden * (w + c + self.heads), c * self.conv_kernel, c, 3 * self.heads, w, w * hidden]

    def flops_per_token(self) -> int:
        """Forward FLOPs of the recurrence per token (the projections are counted with the layer's weights)."""
        if self.new:
            return kinds.flops_per_token(self)
        c, h = self.chunk, self.v_heads
        if self.kind == "gated_deltanet":
            kd, vd = self.k_dim, self.v_dim
            return 2 * h * (c * (3 * kd + vd) + 4 * kd * vd) + 2 * self.conv_channels * self.conv_kernel
        p, n = self.v_dim, self.k_dim
        return 2 * h * (c * (n + p) + 2 * n * p) + 2 * self.conv_channels * self.conv_kernel

    def ulysses_elems(self, u: int) -> tuple[int, int]:
        """Elements per token the Ulysses all-to-alls move in (conv channels + gates) and out (the output)."""
        if self.new:
            return kinds.ulysses_elems(self, u)
        if self.kind == "gated_deltanet":
            inward = self.conv_channels + 2 * self.v_heads
        else:  # groups a rank's heads share go to every such rank (u a multiple of the groups)
            rep = max(1, u // self.groups)
            inward = self.value_width + 2 * self.groups * self.k_dim * rep + self.heads
        return inward, self.value_width

    def state_elems(self, u: int) -> tuple[int, int]:
        """(elements of one state S, of one transition M) per row on one Ulysses rank."""
        if self.new:
            return kinds.state_elems(self, u)
        h = self.v_heads // u
        if self.kind == "gated_deltanet":
            return h * self.k_dim * self.v_dim, h * self.k_dim * self.k_dim
        return h * self.v_dim * self.k_dim, h


def _get(c: dict[str, Any], *names: str) -> Any:
    return next((c[n] for n in names if c.get(n) is not None), None)


# Gated DeltaNet hybrids whose config builds `layer_types` from `full_attention_interval` (default 4) when absent.
INTERVAL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def layer_kinds(c: dict[str, Any]) -> list[str]:
    """A text config dict's per-layer kinds: `layer_types` (Qwen3.5, Granite 4), `layers_block_type` (Nemotron-H),
    or Bamba's `attn_layer_indices` (every other layer is Mamba2; its `layers_block_type` is a property that a
    saved config.json does not hold), or Qwen3-Next / Qwen3.5's `full_attention_interval`."""
    types = c.get("layer_types") or c.get("layers_block_type")
    if types:
        return [str(t) for t in types]
    pattern = c.get("hybrid_override_pattern")  # Nemotron-H's published config.json
    if isinstance(pattern, str) and pattern:
        return [PATTERN_KINDS.get(ch, ch) for ch in pattern]
    attn = c.get("attn_layer_indices")
    if attn is not None and c.get("num_hidden_layers"):
        attn = set(attn)
        return ["attention" if i in attn else "mamba" for i in range(int(c["num_hidden_layers"]))]
    if c.get("model_type") in INTERVAL_TYPES and c.get("num_hidden_layers"):  # as transformers builds layer_types
        every = int(c.get("full_attention_interval") or 4)
        return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(int(c["num_hidden_layers"]))]
    return []


def recurrent_facts(name: str, c: dict[str, Any], kinds: list[str] | None = None) -> RecurrentFacts | None:
    """The recurrent layers' facts from a text config dict (kinds: its layer_kinds, read here if not given); None
    without any recurrent layer (a block-per-mixer decoder's, Nemotron-H: its Mamba2 blocks)."""
    if not any(t in RECURRENT_KINDS for t in (layer_kinds(c) if kinds is None else kinds)):
        return None
    hidden = int(c["hidden_size"])
    k = _get(c, "linear_num_key_heads")
    if k is not None:
        f = RecurrentFacts("gated_deltanet", int(k), int(c["linear_num_value_heads"]), int(c["linear_key_head_dim"]),
                           int(c["linear_value_head_dim"]), 1, int(c.get("linear_conv_kernel_dim") or 4), DELTA_CHUNK)
        return f
    heads = _get(c, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
    if heads is None:
        raise SeqParError(f"model {name!r} has recurrent layers (layer_types) seqpar plan does not know: it models "
                          "Gated DeltaNet (Qwen3.5) and Mamba2 (Granite 4, Bamba) layers")
    head_dim = _get(c, "mamba_d_head", "mamba_head_dim", "mamba_headdim")
    if (head_dim is None or head_dim == "auto") and c.get("mamba_d_ssm"):  # Falcon-H1: heads x head dim = d_ssm
        head_dim = int(c["mamba_d_ssm"]) // int(heads)
    elif head_dim is None or head_dim == "auto":
        head_dim = int(_get(c, "mamba_expand") or 2) * hidden // int(heads)
    f = RecurrentFacts("mamba2", int(heads), int(heads), int(_get(c, "mamba_d_state", "ssm_state_size") or 128),
                       int(head_dim), int(_get(c, "mamba_n_groups", "n_groups", "mamba_ngroups") or 1),
                       int(_get(c, "mamba_d_conv", "conv_kernel") or 4), int(_get(c, "mamba_chunk_size", "chunk_size")
                                                                              or 256))
    return f
