"""Per-token log-probs and entropy under sequence parallelism, for RL loops (GRPO / PPO actors,
reference and old-policy passes in verl / OpenRLHF-style trainers).

    out = token_logps(model, batch, mesh, entropy=True, temperature=0.7)
    out.logps      # [B, S_local] fp32: log p(shift_labels) under softmax(logits / T); 0 where not supervised
    out.entropy    # [B, S_local] fp32 entropy of that distribution (0 where not supervised), or None
    full = gather_tokens(out.logps, mesh)   # [B, S_full], the same on every SP rank (detached)

`batch` is the collator's shard (seqpar.data.SequenceParallelCollator: input_ids, position_ids,
shift_labels, optional cu_seqlens) for a model patched with seqpar.hf.apply_sequence_parallel.
With fused=True (default) no [S_local, vocab] logits tensor exists: the model's lm_head computes the
log-prob (and entropy) of the supervised tokens in checkpointed chunks (seqpar.memory.fused_loss,
the same algorithm as the SFT loss). fused=False runs the plain full-logits path. Both are
differentiable; gradients of a loss built from the LOCAL logps follow the seqpar.loss convention
(each rank's share, gradients summed over dp x sp): see seqpar.loss.grpo_loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SeqParError
from .layout import unshard
from .mesh import SequenceParallelMesh
from .steps import forward_token_stats

__all__ = ["TokenLogps", "token_logps", "gather_tokens"]


@dataclass
class TokenLogps:
    """This rank's per-token results: logps / entropy [B, S_local] fp32, shift_labels (model's device)."""

    logps: torch.Tensor
    entropy: torch.Tensor | None
    shift_labels: torch.Tensor


def token_logps(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    mesh: SequenceParallelMesh,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    fused: bool = True,
) -> TokenLogps:
    """Per-token log-probs of batch["shift_labels"] (and optionally entropy) on this rank's shard.

    temperature: log-probs of softmax(logits / temperature), as the sampler that generated the
    completions (applied in fp32 after the model's own logit transform, e.g. Gemma's softcap).
    chunk_tokens: supervised tokens per chunk of the fused head (None: one chunk's fp32 logits <= 256 MB).
    Runs under the caller's grad mode: wrap reference / old-policy passes in torch.no_grad().
    """
    if not isinstance(mesh, SequenceParallelMesh):
        raise SeqParError(f"mesh must be a SequenceParallelMesh (seqpar.init_mesh), got {type(mesh).__name__}")
    labels = batch.get("shift_labels")
    ids = batch.get("input_ids")
    if not isinstance(labels, torch.Tensor) or not isinstance(ids, torch.Tensor) or labels.shape != ids.shape:
        raise SeqParError("batch needs 'input_ids' and 'shift_labels' of the same [B, S_local] shape "
                          "(seqpar.data.SequenceParallelCollator's output for this rank)")
    if not temperature > 0:
        raise SeqParError(f"temperature must be > 0, got {temperature}")
    nll, ent, labels = forward_token_stats(model, batch, fused, chunk_tokens, temperature=temperature,
                                           entropy=entropy)
    return TokenLogps(-nll, ent, labels)


@torch.no_grad()
def gather_tokens(x_local: torch.Tensor, mesh: SequenceParallelMesh, dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor (e.g. [B, S_full] log-probs) from every SP rank's shard, identical on
    every SP rank, in global token order (undoes the zigzag layout under ring: seqpar.unshard).

    Detached on purpose: for logging, rollouts storage or host-side processing. Build losses from the
    LOCAL shard (each rank's share): backpropagating a gathered copy on every SP rank would count
    each token's gradient sp times.
    """
    if not isinstance(mesh, SequenceParallelMesh):
        raise SeqParError(f"mesh must be a SequenceParallelMesh (seqpar.init_mesh), got {type(mesh).__name__}")
    if x_local.dim() <= dim:
        raise SeqParError(f"gather_tokens: x_local has {x_local.dim()} dims, cannot gather along dim {dim}")
    full = unshard(x_local.detach().to(mesh.comm_device), mesh, dim=dim)
    return full.to(x_local.device)
