"""Mixture-of-experts MLPs (Qwen3-Next, Qwen3.5-MoE): top-k routed experts beside a sigmoid-gated shared expert,
as transformers builds them (its sparse MoE block, run by its default `grouped_mm` experts path).

seqpar has no expert parallelism: every rank holds every expert (weights, gradients, optimizer states), each
token runs its top-k experts and the shared expert, and nothing new crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SeqParError

__all__ = ["MOE_TYPES", "MoeFacts", "moe_facts"]

# Architectures whose MoE block is the one modelled here (router softmax -> top-k, experts as 3D gate_up / down
# tensors, a shared gated-SiLU expert scaled by sigmoid(shared_expert_gate(x))), on every layer.
MOE_TYPES = ("qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")
INDEX_BYTES = 8  # int64


@dataclass(frozen=True)
class MoeFacts:
    experts: int
    top_k: int
    intermediate: int  # each routed expert's
    shared_intermediate: int  # the shared expert's (0: none)
    shared_gate: bool = True  # a sigmoid gate scales the shared expert (Qwen3-Next); Kimi-Linear's has none

    def tensors(self, h: int) -> list[int]:
        """One MoE MLP's parameters: experts' gate_up and down, the router, the shared expert and its gate."""
        n, i, s = self.experts, self.intermediate, self.shared_intermediate
        return [n * 2 * i * h, n * h * i, n * h] + ([h * s, h * s, s * h] if s else []) + ([h] if self.shared_gate
                                                                                          else [])

    def active_params(self, h: int) -> int:
        """Weights one token multiplies by: its top-k experts, the router, the shared expert and its gate."""
        gate = h if self.shared_gate else 0
        return self.top_k * 3 * self.intermediate * h + self.experts * h + 3 * self.shared_intermediate * h + gate

    def saved_bytes(self, e: int, h: int) -> int:
        """What the MoE block keeps for backward per token (its input, the norm's output, is counted by the norm).
        Per routed (token, expert) slot, grouped_mm path: the gathered input e h (up grouped_mm), the up output
        2 e I (SiLU's gate and the product's up), SiLU's output and the product e I each (down grouped_mm's input),
        the down output e h and the routing weight e (their product), three int64 indices (the gather, the weights'
        permutation, the un-permute). Per token: the router's fp32 softmax 4 E, top-k's int64 indices and fp32
        values, the top-k sum (fp32) it is normalised by; the shared expert's gate, up, SiLU and product 4 e I_s;
        its gate's sigmoid e and the shared output e h (their product; an ungated shared expert, or none, keeps
        neither: Jamba, MiniMax, Kimi-Linear)."""
        k, i = self.top_k, self.intermediate
        slot = 2 * e * h + 4 * e * i + e + 3 * INDEX_BYTES
        gated = e + e * h if self.shared_gate else 0  # (ungated, Jamba / MiniMax / Kimi-Linear: a plain sum keeps none)
        return k * slot + 4 * self.experts + k * (INDEX_BYTES + 4) + 4 + 4 * e * self.shared_intermediate + gated

    def backward_temp(self, e: int, h: int) -> int:
        """The MoE moment's temporaries per token beside the residual-stream gradient, when the routing-weight
        product's backward runs (before any expert's gradient; every saved tensor still alive): per routed slot
        e h each for the gradient through the top-k sum (expanded), the un-permute's scatter, the down output's
        gradient and the [slot, h] product reduced into the routing weight's gradient (MemTracker on the stock
        block: these 4 e k h exactly)."""
        return 4 * self.top_k * e * h


def moe_facts(name: str, c: dict[str, Any]) -> MoeFacts | None:
    """A Qwen3-Next / Qwen3.5-MoE config's MoE MLP (None without experts); anything the model would build
    otherwise (dense MLP layers among MoE ones, another experts implementation) is refused. (The router's aux loss,
    output_router_logits=True, is refused before, by seqpar train's own check: planner.model's _trainer_view.)"""
    n = c.get("num_experts")
    if not isinstance(n, int) or n <= 1:
        return None
    if c.get("model_type") not in MOE_TYPES:
        raise SeqParError(f"model {name!r}: its mixture-of-experts MLPs ({c.get('model_type')}) are not modelled: "
                          f"seqpar plan models the MoE block of {', '.join(MOE_TYPES)}; measure this model instead "
                          "(seqpar train with `memory:` features logs peak memory per step)")
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step") or 1) != 1:
        raise SeqParError(f"model {name!r}: dense MLP layers among MoE ones (mlp_only_layers / decoder_sparse_step) "
                          "are not modelled: seqpar plan models an MoE MLP in every layer")
    impl = c.get("experts_implementation") or c.get("_experts_implementation")
    if impl not in (None, "grouped_mm"):
        raise SeqParError(f"model {name!r}: experts_implementation={impl!r}: seqpar plan models transformers' default "
                          "grouped_mm experts (what seqpar train loads); drop the setting from the config")
    return MoeFacts(experts=n, top_k=int(c["num_experts_per_tok"]), intermediate=int(c["moe_intermediate_size"]),
                    shared_intermediate=int(c.get("shared_expert_intermediate_size") or 0))
