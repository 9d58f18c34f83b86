"""GRPO / BNPO / Dr. GRPO policy loss under sequence parallelism, normalised over the whole step.

Inputs are THIS rank's per-token tensors [B, S_local] (`seqpar.rl.token_logps`), one advantage per
row [B] (identical on the SP ranks of a group), and the GLOBAL counts of the optimizer step
(`grpo_denominators`: all grad-accumulation micro-batches, summed over dp; SP ranks share rows).
Per completion token t (mask = shift_labels != -100), as TRL's GRPOTrainer (token-level importance
sampling, two-sided PPO clip):

    ratio_t = exp(logp_t - old_t)               (old = logp.detach() when not given: ratio 1, same gradient)
    loss_t  = -min(ratio_t * A, clamp(ratio_t, 1 - eps_low, 1 + eps_high) * A) * w_t + beta * k3_t
    k3_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
    w_t     = the importance weight of a sampler whose log-probs differ from the trainer's (`importance` given;
              else 1): TRL's vllm_importance_sampling_correction, its four modes (seqpar.loss.importance):
              detached, on the policy term only (not the KL)

Aggregation (`loss_type`):
    "grpo":    mean over the step's sequences of (sum of the sequence's loss_t / its completion-token count)
    "bnpo":    sum of loss_t over the step / the step's completion-token count
    "dr_grpo": sum of loss_t over the step / (number of sequences * max_completion_length)

Each rank's share holds only its own tokens (a sequence's global token count, needed by "grpo",
comes from an all-reduce WITHOUT gradient), so the shares of all dp x sp ranks sum to the loss and
no autograd collective is needed: gradients are SUMMED over dp x sp as for every seqpar loss (see
the `seqpar.loss` docstring).

Normalisation vs TRL: TRL normalises each micro-batch on its own and divides by the number of
accumulation steps (and DDP averages over processes); here every denominator is the step's global
count, so the loss is the same whatever the micro-batch split. The two agree when every micro-batch
on every rank has the same number of sequences ("grpo", "dr_grpo") or of completion tokens ("bnpo").
A sequence whose completion is entirely truncated (no supervised token) still counts as a sequence
for "grpo" and "dr_grpo" and contributes 0, as in TRL (its per-sequence mean is 0 / clamp(0, 1)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .importance import ImportanceSampling, importance_metrics, importance_weight
from .nll import IGNORE_INDEX, upcast

__all__ = ["GRPO_LOSS_TYPES", "GRPODenominators", "grpo_denominators", "grpo_local_counts", "grpo_loss"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")


@dataclass
class GRPODenominators:
    """GLOBAL counts of one optimizer step (all micro-batches, summed over dp; identical on every rank).

    num_sequences: rows (completions), including rows whose completion was truncated away.
    num_tokens: supervised completion tokens. max_completion_length: the generation limit ("dr_grpo").
    """

    num_sequences: torch.Tensor
    num_tokens: torch.Tensor
    max_completion_length: int = 0

    @classmethod
    def from_counts(cls, counts: torch.Tensor, max_completion_length: int | None) -> GRPODenominators:
        """From a long tensor [num_sequences, num_tokens] that is already global (see `grpo_local_counts`)."""
        c = torch.as_tensor(counts).detach().long().reshape(-1)
        if c.numel() != 2:
            raise SeqParError(
                f"GRPO needs the step's counts [num_sequences, num_tokens] (count_items(micro_batches, 'grpo') "
                f"reduced with global_token_count, or grpo_denominators), got a tensor of shape {tuple(c.shape)}"
            )
        return cls(c[0], c[1], int(max_completion_length or 0))


def _check_batch(batch: dict, i: int) -> torch.Tensor:
    labels = batch.get("shift_labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.dtype.is_floating_point:
        raise SeqParError(f"GRPO micro-batch {i}: needs 'shift_labels', an integer [B, S_local] tensor")
    if batch.get("cu_seqlens") is not None:
        raise SeqParError(
            f"GRPO micro-batch {i} is packed (cu_seqlens): GRPO needs one completion per row (one advantage "
            "per row): collate with packing=False"
        )
    return labels


def grpo_local_counts(micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
    """This dp rank's [num_sequences, num_tokens] (long) over the step's micro-batches, from the
    collator's full-batch "num_supervised_tokens" (identical on SP ranks): reduce over dp only
    (`seqpar.loss.global_token_count`)."""
    rows = tokens = 0
    for i, b in enumerate(micro_batches):
        labels = _check_batch(b, i)
        if b.get("num_supervised_tokens") is None:
            raise SeqParError(
                f"GRPO micro-batch {i} has no 'num_supervised_tokens' (the collator's full-batch count): build it "
                "with seqpar.data.SequenceParallelCollator, or count from shift_labels with grpo_denominators"
            )
        rows += labels.shape[0]
        tokens += int(b["num_supervised_tokens"])
    return torch.tensor([rows, tokens], dtype=torch.long)


def grpo_denominators(
    micro_batches: Sequence[dict[str, torch.Tensor]],
    mesh: SequenceParallelMesh | None,
    max_completion_length: int = 0,
) -> GRPODenominators:
    """The step's GRPODenominators, counted from every micro-batch's (sharded) "shift_labels".

    Rows are counted once per SP group (SP rank 0's), tokens on every SP rank's shard; both summed over
    sp then dp, so every rank gets the same values. Call it BEFORE the first forward of the step.
    """
    if not isinstance(max_completion_length, int) or max_completion_length < 0:
        raise SeqParError(f"max_completion_length must be an int >= 0, got {max_completion_length!r}")
    rows = tokens = 0
    for i, b in enumerate(micro_batches):
        labels = _check_batch(b, i)
        rows += labels.shape[0]
        tokens += int((labels != IGNORE_INDEX).sum())
    sp_rank = 0 if mesh is None else mesh.sp_rank
    t = torch.tensor([rows if sp_rank == 0 else 0, tokens], dtype=torch.long)
    if mesh is not None and mesh.world_size > 1:
        t = t.to(mesh.comm_device)
        comm.all_reduce_(t, mesh.sp_group, device=mesh.comm_device)
        comm.all_reduce_(t, mesh.dp_group, device=mesh.comm_device)
        t = t.cpu()
    return GRPODenominators(t[0], t[1], max_completion_length)


def _check_loss_inputs(logps, advantages, shift_labels, denominators, old_logps, ref_logps, beta, eps_low,
                       eps_high, loss_type) -> None:
    if loss_type not in GRPO_LOSS_TYPES:
        raise SeqParError(f"loss_type={loss_type!r} is unknown: use one of {GRPO_LOSS_TYPES}")
    if not isinstance(denominators, GRPODenominators):
        raise SeqParError("denominators must be a GRPODenominators (seqpar.loss.grpo_denominators)")
    if loss_type == "dr_grpo" and denominators.max_completion_length < 1:
        raise SeqParError("loss_type='dr_grpo' needs max_completion_length >= 1 (the generation length limit)")
    if beta < 0 or not 0 <= eps_low < 1 or eps_high < 0:
        raise SeqParError(f"need beta >= 0, 0 <= epsilon_low < 1, epsilon_high >= 0; got {beta}, {eps_low}, {eps_high}")
    if (beta != 0) != (ref_logps is not None):
        raise SeqParError(f"ref_logps (per-token reference log-probs) is needed iff beta != 0 (beta={beta})")
    if logps.dim() != 2 or not logps.dtype.is_floating_point or tuple(shift_labels.shape) != tuple(logps.shape):
        raise SeqParError(f"logps must be float [B, S_local] like shift_labels; got {tuple(logps.shape)} "
                          f"{logps.dtype} and {tuple(shift_labels.shape)}")
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if t is not None and tuple(t.shape) != tuple(logps.shape):
            raise SeqParError(f"{name} must be [B, S_local] like logps {tuple(logps.shape)}, got {tuple(t.shape)}")
    if tuple(torch.as_tensor(advantages).shape) != (logps.shape[0],):
        raise SeqParError(f"advantages must be [B] = ({logps.shape[0]},) (one per row), got "
                          f"{tuple(torch.as_tensor(advantages).shape)}")


def _reduce(t: torch.Tensor, group, mesh: SequenceParallelMesh | None, op=None) -> torch.Tensor:
    if mesh is None:
        return t
    # clone: the in-place all-reduce must not write into the caller's tensor (or one sharing its storage)
    out = comm.all_reduce_(t.detach().clone().to(mesh.comm_device), group, op, device=mesh.comm_device)
    return out.to(t.device)


def _metrics(rows: torch.Tensor, mesh: SequenceParallelMesh | None, beta: float,
             with_entropy: bool) -> dict[str, torch.Tensor]:
    """rows: per-row [count, kl, entropy, low, high, region(, weight, capped)] sums over the FULL row (already
    SP-reduced; the last two with importance sampling)."""
    totals = _reduce(rows.sum(0), None if mesh is None else mesh.dp_group, mesh)
    mean = totals[1:] / totals[0].clamp(min=1.0)
    valid = rows[:, 0] > 0  # TRL's nanmin/nanmax skip rows without completion tokens
    cnt = rows[:, 0].clamp(min=1.0)
    inf = torch.tensor(float("inf"), dtype=rows.dtype, device=rows.device)
    low_min = torch.where(valid, rows[:, 3] / cnt, inf).min() if rows.shape[0] else inf
    high_max = torch.where(valid, rows[:, 4] / cnt, -inf).max() if rows.shape[0] else -inf
    ext = _reduce(torch.stack([low_min, -high_max]), None if mesh is None else mesh.dp_group, mesh,
                  dist.ReduceOp.MIN)
    ext = torch.where(torch.isinf(ext), torch.zeros_like(ext), ext)  # no completion token anywhere: 0, not inf
    out = {"clip_ratio/low_mean": mean[2], "clip_ratio/high_mean": mean[3], "clip_ratio/region_mean": mean[4],
           "clip_ratio/low_min": ext[0], "clip_ratio/high_max": -ext[1]}
    if beta != 0:
        out["kl"] = mean[0]
    if with_entropy:
        out["entropy"] = mean[1]
    if rows.shape[1] > 6:
        out["importance_ratio/mean"], out["importance_ratio/capped"] = mean[5], mean[6]
    return out


def grpo_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    shift_labels: torch.Tensor,
    denominators: GRPODenominators,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "bnpo",
    mesh: SequenceParallelMesh | None = None,
    entropy: torch.Tensor | None = None,
    kl_ratio_correction: bool = False,
    sampling_logps: torch.Tensor | None = None,
    importance: ImportanceSampling | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This rank's share of the step's GRPO loss, and detached metrics (formulas: module docstring).

    kl_ratio_correction: k3 KL x the differentiable ratio, TRL's use_bias_correction_kl (same value on-policy).
    sampling_logps / importance: the sampler's per-token log-probs [B, S_local] and the importance-sampling spec
    (both or neither); metrics then add "importance_ratio/mean" (w_t's mean over completion tokens),
    "importance_ratio/capped" (fraction of completion tokens outside the bounds) and TRL's
    sampling/importance_sampling_ratio/min|mean|max (seqpar.loss.importance.importance_metrics).
    logps / old_logps / ref_logps / entropy: this rank's per-token [B, S_local] (values where not
    supervised are ignored). advantages: [B], the same on every SP rank. Gradient through logps only.
    Returns (share, metrics); metrics are GLOBAL over sp x dp for this micro-batch, with TRL's names:
    clip_ratio/low_mean|high_mean|region_mean|low_min|high_max, "kl" (beta != 0), "entropy" (when given).
    Collectives (no gradient, the same on every rank): per-row sums over sp, totals over dp."""
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    _check_loss_inputs(logps, advantages, shift_labels, denominators, old_logps, ref_logps, beta, epsilon_low,
                       eps_high, loss_type)
    lp = upcast(logps)
    mask = shift_labels.to(lp.device) != IGNORE_INDEX
    adv = torch.as_tensor(advantages).detach().to(lp)[:, None]
    weight, capped = _importance(lp, mask, old_logps, sampling_logps, importance, mesh)
    per_tok, ratio, kl = _token_losses(lp, mask, adv, old_logps, ref_logps, beta, epsilon_low, eps_high,
                                       kl_ratio_correction, weight)
    r = ratio.detach()
    low = mask & (r < 1 - epsilon_low) & (adv < 0)
    high = mask & (r > 1 + eps_high) & (adv > 0)
    zero = torch.zeros_like(lp)
    ent = zero if entropy is None else torch.where(mask, entropy.detach().to(lp), zero)
    cols = [mask.to(lp.dtype), kl.detach() * mask, ent, low.to(lp.dtype), high.to(lp.dtype), (low | high).to(lp.dtype)]
    if weight is not None:
        cols += [torch.where(mask, weight, zero), capped.to(lp.dtype)]
    stats = torch.stack(cols, dim=-1).sum(1)  # [B, 6 (+2)] local sums per row
    rows = _reduce(stats.detach(), None if mesh is None else mesh.sp_group, mesh)  # full rows (no gradient)
    n_seq = denominators.num_sequences.to(lp).clamp(min=1.0)
    if loss_type == "grpo":
        share = (per_tok.sum(1) / rows[:, 0].clamp(min=1.0)).sum() / n_seq
    elif loss_type == "bnpo":
        share = per_tok.sum() / denominators.num_tokens.to(lp).clamp(min=1.0)
    else:
        share = per_tok.sum() / (n_seq * denominators.max_completion_length)
    met = _metrics(rows, mesh, beta, entropy is not None)
    if weight is not None:
        met.update(importance_metrics(weight.detach(), mask, rows[:, [0, 6]], importance.level, mesh))
    return share, met


def _importance(lp: torch.Tensor, mask: torch.Tensor, old_logps: torch.Tensor | None,
                sampling_logps: torch.Tensor | None, importance: ImportanceSampling | None,
                mesh: SequenceParallelMesh | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(w_t [B, S_local] detached, where the ratio fell outside the bounds) or (None, _) without correction.
    old_t as the ratio's (the trainer's log-probs at the rollout)."""
    if (sampling_logps is None) != (importance is None):
        raise SeqParError(f"importance sampling needs both sampling_logps and importance, got "
                          f"{'no ' if sampling_logps is None else ''}sampling_logps and importance={importance}")
    if importance is None:
        return None, mask
    old = lp.detach() if old_logps is None else old_logps.detach().to(lp)
    return importance_weight(old, sampling_logps, mask, importance, mesh)


def _token_losses(lp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, old_logps: torch.Tensor | None,
                  ref_logps: torch.Tensor | None, beta: float, eps_low: float, eps_high: float,
                  kl_ratio_correction: bool,
                  weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_t, ratio_t, k3_t) per token [B, S_local] (module docstring), 0 where not supervised."""
    zero = torch.zeros_like(lp)
    old = lp.detach() if old_logps is None else old_logps.detach().to(lp)
    # where() before exp(): values at unsupervised positions never reach exp (no inf * 0 = NaN in backward)
    ratio = torch.exp(torch.where(mask, lp - old, zero))
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_tok = -torch.min(ratio * adv, clipped * adv)
    if weight is not None:  # importance sampling: the policy term only, before the KL is added (TRL)
        per_tok = per_tok * weight
    kl = zero
    if beta != 0:
        d = torch.where(mask, ref_logps.detach().to(lp) - lp, zero)
        kl = torch.exp(d) - d - 1
        if kl_ratio_correction:
            kl = kl * ratio
        per_tok = per_tok + beta * kl
    return torch.where(mask, per_tok, zero), ratio, kl
