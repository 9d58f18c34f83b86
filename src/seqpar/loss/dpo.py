"""The DPO family from SP-reduced per-sequence log-probs: `sequence_logps` (one differentiable sum over the SP
group per row) and `dpo_loss` (DPO / IPO / SimPO), each rank's share built per the `seqpar.loss` convention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .counts import global_token_count
from .nll import IGNORE_INDEX, check_inputs, per_token_nll, upcast

__all__ = ["DPO_LOSS_TYPES", "sequence_logps", "sequence_logps_from_nll", "dpo_loss"]

DPO_LOSS_TYPES = ("sigmoid", "ipo", "simpo")


def sequence_logps(
    logits: torch.Tensor | None,
    shift_labels: torch.Tensor,
    mesh: SequenceParallelMesh | None,
    *,
    hidden: torch.Tensor | None = None,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sum of target log-probs over the FULL sequence, and per-row supervised counts.

    Each rank sums its own tokens, then one differentiable sum all-reduce over the SP group gives
    every SP rank the same full-row values (backward sums gradients over the group: see the module
    docstring -- `dpo_loss(mesh=...)` accounts for it).
    Returns (logps [B] fp32 (fp64 for fp64 inputs), counts [B] long).
    """
    check_inputs(logits, hidden, lm_head, shift_labels)
    nll = per_token_nll(logits, shift_labels, hidden, lm_head, chunk_size, ignore_index)
    return sequence_logps_from_nll(nll, shift_labels, mesh, ignore_index=ignore_index)


def sequence_logps_from_nll(
    nll: torch.Tensor, shift_labels: torch.Tensor, mesh: SequenceParallelMesh | None, *,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` from a per-token NLL [B, S_local] (0 where not supervised), e.g. the fused head's."""
    local_logps = -nll.sum(dim=1)
    local_counts = (shift_labels != ignore_index).sum(dim=1).to(device=nll.device, dtype=nll.dtype)
    b = local_logps.shape[0]
    # One collective for both (counts < 2^24 per row are exact in fp32; they carry no gradient).
    both = torch.cat([local_logps, local_counts])
    if mesh is not None:
        both = comm.all_reduce(both, mesh.sp_group, stats=mesh.stats, device=mesh.comm_device)
    return both[:b], both[b:].detach().round().long()



def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    chosen_counts: torch.Tensor | None = None,
    rejected_counts: torch.Tensor | None = None,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    mesh: SequenceParallelMesh | None = None,
    num_pairs: torch.Tensor | int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO / IPO / SimPO from SP-reduced per-sequence log-probs (`sequence_logps`, same on all SP ranks).

    loss_type:
      "sigmoid": l = -logsigmoid(beta * ((pc - rc) - (pr - rr))) (with optional label_smoothing).
      "ipo":     same log-ratios on length-normalised log-probs (logps / counts, divided AFTER the
                 SP reduction), l = (ratio - 1 / (2 beta))^2. Needs chosen_counts/rejected_counts.
      "simpo":   l = -logsigmoid(beta * (pc / cc - pr / cr) - gamma); no reference model.
    num_pairs: the GLOBAL number of pairs of the optimizer step (all dp ranks and grad-accum
    micro-batches); None = this micro-batch's pairs summed over dp (one all-reduce).

    Returns (loss_share, metrics). loss_share = sum of this rank's pair losses / (num_pairs * sp):
    every SP rank holds the same reduced log-probs and the all-reduce backward sums the sp ranks'
    gradients, so each rank contributes 1/sp. Sum gradients over dp x sp (module docstring).
    metrics (detached, over this dp rank's pairs, identical on its SP ranks): "loss" (the true mean
    pair loss), "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected".
    """
    _check_dpo_inputs(policy_chosen, policy_rejected, ref_chosen, ref_rejected, loss_type, chosen_counts,
                      rejected_counts, beta)
    losses, chosen_rewards, rejected_rewards = _pair_losses(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, loss_type, chosen_counts, rejected_counts,
        gamma, label_smoothing)
    sp = 1 if mesh is None else mesh.sp_size
    if num_pairs is None:
        num_pairs = global_token_count(losses.shape[0], mesh)
    denom = torch.as_tensor(num_pairs, device=losses.device).detach().to(losses.dtype).clamp(min=1.0) * sp
    share = losses.sum() / denom
    cr_d, rr_d = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "loss": losses.detach().mean(),
        "rewards/chosen": cr_d.mean(),
        "rewards/rejected": rr_d.mean(),
        "rewards/accuracies": (cr_d > rr_d).float().mean(),
        "rewards/margins": (cr_d - rr_d).mean(),
        "logps/chosen": upcast(policy_chosen.detach()).mean(),
        "logps/rejected": upcast(policy_rejected.detach()).mean(),
    }
    return share, metrics


def _check_dpo_inputs(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
                      ref_rejected: torch.Tensor | None, loss_type: str, chosen_counts: torch.Tensor | None,
                      rejected_counts: torch.Tensor | None, beta: float) -> None:
    if loss_type not in DPO_LOSS_TYPES:
        raise SeqParError(f"loss_type={loss_type!r} is unknown: use one of {DPO_LOSS_TYPES}")
    if policy_chosen.dim() != 1 or policy_chosen.shape != policy_rejected.shape or policy_chosen.numel() == 0:
        raise SeqParError(
            f"policy_chosen/policy_rejected must be non-empty [B] tensors of equal shape, got "
            f"{tuple(policy_chosen.shape)} and {tuple(policy_rejected.shape)}"
        )
    if loss_type != "simpo" and (ref_chosen is None or ref_rejected is None):
        raise SeqParError(f"loss_type={loss_type!r} needs ref_chosen and ref_rejected (reference model log-probs)")
    if loss_type in ("ipo", "simpo") and (chosen_counts is None or rejected_counts is None):
        raise SeqParError(
            f"loss_type={loss_type!r} length-normalises: pass chosen_counts/rejected_counts from sequence_logps"
        )
    if beta <= 0:
        raise SeqParError(f"beta must be > 0, got {beta}")


def _pair_losses(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None, beta: float, loss_type: str, chosen_counts: torch.Tensor | None,
    rejected_counts: torch.Tensor | None, gamma: float, label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses [B] and the chosen / rejected rewards [B] (fp32, or fp64 for fp64 log-probs)."""
    pc, pr = upcast(policy_chosen), upcast(policy_rejected)
    if loss_type != "simpo":
        rc, rr = upcast(ref_chosen.detach()).to(pc.dtype), upcast(ref_rejected.detach()).to(pc.dtype)
    if loss_type in ("ipo", "simpo"):
        cc = torch.as_tensor(chosen_counts, device=pc.device).to(pc.dtype).clamp(min=1.0)
        cr = torch.as_tensor(rejected_counts, device=pc.device).to(pc.dtype).clamp(min=1.0)
        pc, pr = pc / cc, pr / cr
        if loss_type == "ipo":
            rc, rr = rc / cc, rr / cr
    if loss_type == "simpo":
        chosen_rewards, rejected_rewards = beta * pc, beta * pr
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    else:
        logratio = (pc - rc) - (pr - rr)
        chosen_rewards, rejected_rewards = beta * (pc - rc), beta * (pr - rr)
        if loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * logratio) * (1 - label_smoothing) - F.logsigmoid(
                -beta * logratio
            ) * label_smoothing
        else:
            losses = (logratio - 1.0 / (2.0 * beta)) ** 2
    return losses, chosen_rewards, rejected_rewards
