"""Reference-model log-probs for DPO (per sequence) and GRPO's KL term (per token), under SP.

Either a frozen copy of the model or the policy itself with its LoRA adapter disabled; no gradients.
"""

from __future__ import annotations

import torch

from .. import loss as L
from ..mesh import SequenceParallelMesh
from .forward import forward_nll, forward_token_stats

__all__ = ["ReferenceLogps", "ReferenceTokenLogps"]


class ReferenceLogps:
    """Reference-model log-probs for DPO: a frozen copy, or the policy with its LoRA adapter disabled."""

    def __init__(self, mesh: SequenceParallelMesh, ref_model: torch.nn.Module | None = None,
                 policy: torch.nn.Module | None = None, *, fused_loss: bool = True,
                 loss_chunk_tokens: int | None = None) -> None:
        if (ref_model is None) == (policy is None):
            raise ValueError("give exactly one of ref_model (frozen copy) or policy (a PEFT model: adapter disabled)")
        self.mesh, self.ref_model, self.policy = mesh, ref_model, policy
        self.fused_loss, self.loss_chunk_tokens = fused_loss, loss_chunk_tokens

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ref_model is not None:
            nll, labels = forward_nll(self.ref_model, batch, self.fused_loss, self.loss_chunk_tokens)
        else:
            with self.policy.disable_adapter():
                nll, labels = forward_nll(self.policy, batch, self.fused_loss, self.loss_chunk_tokens)
        return L.sequence_logps_from_nll(nll, labels, self.mesh)


class ReferenceTokenLogps:
    """Per-token reference log-probs [B, S_local] for GRPO's KL term (0 where not supervised): a frozen
    copy, or the policy with its LoRA adapter disabled; at the policy's sampling temperature."""

    def __init__(self, ref_model: torch.nn.Module | None = None, policy: torch.nn.Module | None = None, *,
                 fused_loss: bool = True, loss_chunk_tokens: int | None = None, temperature: float = 1.0) -> None:
        if (ref_model is None) == (policy is None):
            raise ValueError("give exactly one of ref_model (frozen copy) or policy (a PEFT model: adapter disabled)")
        self.ref_model, self.policy = ref_model, policy
        self.fused_loss, self.loss_chunk_tokens, self.temperature = fused_loss, loss_chunk_tokens, temperature

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        kw = dict(temperature=self.temperature)
        if self.ref_model is not None:
            nll, _, _ = forward_token_stats(self.ref_model, batch, self.fused_loss, self.loss_chunk_tokens, **kw)
        else:
            with self.policy.disable_adapter():
                nll, _, _ = forward_token_stats(self.policy, batch, self.fused_loss, self.loss_chunk_tokens, **kw)
        return -nll
