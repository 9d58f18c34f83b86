"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) for the planner: its projections and head dims.

q goes through a low-rank pair q_a (to q_lora_rank, an RMSNorm) and q_b (or one q_proj without q_lora_rank); k and v
come from one kv_a projection to a latent of kv_lora_rank (an RMSNorm) plus the RoPE part of k every head shares,
then kv_b to every head's k_nope and v. q / k's head dim is qk_nope + qk_rope (ModelFacts.head_dim), v's
v_head_dim (ModelFacts.v_head_dim). The kernels that need equal dims get v padded to q / k's dim (and their output
sliced), so everything from the attention call on is priced at q / k's head dim; o_proj's input at v's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MlaFacts", "mla_fields"]


@dataclass(frozen=True)
class MlaFacts:
    q_lora_rank: int | None
    kv_lora_rank: int
    rope_dim: int  # qk_rope_head_dim: the part of k shared by all heads


def mla_fields(hf: Any) -> dict[str, Any]:
    """ModelFacts' MLA fields (head_dim, v_head_dim, mla) from a transformers config; {} without MLA."""
    rank = getattr(hf, "kv_lora_rank", None)
    if not rank:
        return {}
    rope, nope = int(hf.qk_rope_head_dim), int(hf.qk_nope_head_dim)
    q_rank = getattr(hf, "q_lora_rank", None)
    return {"head_dim": nope + rope, "v_head_dim": int(getattr(hf, "v_head_dim", None) or nope + rope),
            "mla": MlaFacts(int(q_rank) if q_rank else None, int(rank), rope)}
