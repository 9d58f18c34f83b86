"""`grpo.rollout:` -- which engine samples GRPO's completions (docs/grpo.md, "The vLLM engine")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ...errors import SeqParError
from .base import StrictModel as _Strict

__all__ = ["RolloutSpec", "resolve_tensor_parallel"]


class RolloutSpec(_Strict):
    """engine: "transformers" (generate() on the policy itself) or "vllm" (an in-process vLLM engine per rank, fed
    the policy's weights before every rollout). The other fields are the vLLM engine's:

    mode: "colocate" (the engines live in the training processes).
    tensor_parallel: "sp" (default: one engine per SP group, its vLLM tensor-parallel group the SP group's ranks; each
      rank holds 1/SP of the engine's weights and KV cache and every rank of the group gets the group's
      completions) or 1 (one engine per rank; each samples its SP rank's share of the group's prompts); an integer
      equal to the SP size means "sp" (resolve_tensor_parallel, checked before launch).
    gpu_memory_utilization: the fraction of a GPU's memory the engine may take (on CPU the KV cache is sized for the
      rollout instead: vLLM reads this fraction as one of the host's memory).
    sleep: CUDA: the engine sleeps (level 2: weights and KV cache freed) after each rollout while the policy trains,
      and wakes for the next rollout's weight push (a no-op on CPU, said once: vLLM's CPU platform has no sleep mode).
    max_model_len: the longest prompt + completion the engine holds (None: dataset.max_length).
    enforce_eager: no compiled graphs (True: a fast start, what CPU tests want).
    """

    engine: Literal["transformers", "vllm"] = "transformers"
    mode: Literal["colocate", "server"] = "colocate"
    tensor_parallel: Literal["sp"] | int = "sp"
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    sleep: bool = False
    max_model_len: int | None = Field(default=None, ge=1)
    enforce_eager: bool = True

    @model_validator(mode="after")
    def _checks(self) -> RolloutSpec:
        if self.mode == "server":
            raise ValueError("grpo.rollout.mode: server (a separate vLLM server fed over the network) is not "
                             "supported yet: use mode: colocate (an engine inside every training process)")
        if isinstance(self.tensor_parallel, int) and self.tensor_parallel < 1:
            raise ValueError(f"grpo.rollout.tensor_parallel={self.tensor_parallel}: use sp (one engine per SP group) "
                             "or 1 (one engine per rank)")
        return self


def resolve_tensor_parallel(spec: RolloutSpec, sp_size: int) -> int:
    """The vLLM engines' tensor-parallel size at SP size `sp_size`: the SP size ("sp") or 1. Any other value is
    refused: vLLM's external launcher forms its TP groups from consecutive ranks of the whole world, which are
    seqpar's SP groups (ranks dp-major, SP innermost) only when the TP size is the SP size."""
    tp = spec.tensor_parallel
    if tp == "sp":
        return sp_size
    if tp not in (1, sp_size):
        raise SeqParError(f"grpo.rollout.tensor_parallel={tp} with sequence_parallel size {sp_size}: the engines' "
                          f"tensor-parallel group must be the SP group or one rank: set tensor_parallel: sp (= "
                          f"{sp_size}) or 1")
    return int(tp)
