"""Losses for sequence-parallel training: token-normalised SFT cross-entropy, DPO/IPO/SimPO, and the
GRPO family (`seqpar.loss.grpo`, re-exported here).

Gradient convention (every function here follows it)
----------------------------------------------------
Each rank returns its SHARE of the true global loss, built so that

    sum over all dp x sp ranks of (each rank's parameter gradients) == gradient of the true loss.

So after `loss_share.backward()` on every rank (and every grad-accumulation micro-batch), the
parameter gradients must be SUMMED over the whole dp x sp world:
- by hand: `seqpar.loss.sum_gradients(model.parameters(), mesh)` after backward, or
  `seqpar.loss.OverlappedGradSum` (the same sums, posted during the last backward);
- with DDP / FSDP over all dp x sp ranks, which AVERAGE: multiply each loss share by
  `gradient_reduction_factor(mesh)` (= dp_size * sp_size) before backward, so the average becomes
  the sum. (A wrapper that only spans dp must still have the sp ranks' gradients summed.)
The VALUE of a share is not the loss: `global_loss(share, mesh)` sums the shares for logging.

Why shares and not the plain loss: SP ranks hold different tokens, and collectives with autograd
(all-to-all in attention, the all-reduce of per-sequence log-probs) route gradient to the ranks
that own the inputs. If every SP rank backpropagated the same reduced DPO loss, the all-reduce
backward would sum sp identical gradients: each rank therefore backpropagates 1/sp of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .grad_sync import OverlappedGradSum, fill_missing_grads
from .grpo import GRPO_LOSS_TYPES, GRPODenominators, grpo_denominators, grpo_local_counts, grpo_loss

__all__ = [
    "IGNORE_INDEX",
    "global_token_count",
    "sft_loss",
    "sequence_logps",
    "sft_loss_from_nll",
    "sequence_logps_from_nll",
    "chunked_token_nll",
    "chunked_token_stats",
    "token_nll",
    "token_logprob_stats",
    "token_metric_stats",
    "TOKEN_METRICS",
    "dpo_loss",
    "gradient_reduction_factor",
    "sum_gradients",
    "OverlappedGradSum",
    "global_loss",
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "GRPODenominators",
    "grpo_denominators",
    "grpo_local_counts",
    "grpo_loss",
]

IGNORE_INDEX = -100
DPO_LOSS_TYPES = ("sigmoid", "ipo", "simpo")
# Detached per-token statistics for logging (`chunked_token_stats(metrics=)`, `token_metric_stats`), TRL's
# definitions: the entropy of the next-token distribution, 1.0 where the target is its argmax (the FIRST maximum,
# as torch.argmax: a tie with an earlier token is not a hit), and the mean logit over the vocabulary.
TOKEN_METRICS = ("entropy", "is_top1", "mean_logits")


# ----------------------------------------------------------------------------- counts and reductions
def _groups(mesh: SequenceParallelMesh | None) -> tuple[Any, Any]:
    return (None, None) if mesh is None else (mesh.sp_group, mesh.dp_group)


def global_token_count(local_count: torch.Tensor | int, mesh: SequenceParallelMesh | None) -> torch.Tensor:
    """Sum a FULL-batch count over dp (SP ranks of a group share the same count, so not over sp).

    `local_count` is what the collator reports for this dp rank (e.g. "num_supervised_tokens"),
    summed over all grad-accumulation micro-batches of the step. Returns a new long tensor, the
    same on every rank: the denominator for `sft_loss`. On a CUDA (NCCL) mesh it lives on the
    current CUDA device, elsewhere where `local_count` was.
    """
    t = torch.as_tensor(local_count).detach().clone().long()
    if mesh is not None and mesh.dp_size > 1:
        t = t.to(mesh.comm_device)
        comm.all_reduce_(t, mesh.dp_group, device=mesh.comm_device)
    return t


def gradient_reduction_factor(mesh: SequenceParallelMesh | None) -> float:
    """Multiply each loss share by this when the wrapper AVERAGES gradients over dp x sp (DDP, FSDP).

    Our shares need a SUM of gradients over all dp * sp ranks; an average divides by dp * sp.
    """
    return 1.0 if mesh is None else float(mesh.dp_size * mesh.sp_size)


@torch.no_grad()
def sum_gradients(parameters: Iterable[torch.nn.Parameter], mesh: SequenceParallelMesh | None) -> None:
    """SUM .grad of replicated parameters over sp, then dp (i.e. over the whole world), in place.

    Parameters without a gradient get a zero one, so every rank issues the same collectives.
    Large gradients are reduced in place, small ones through one buffer (`seqpar.comm.all_reduce_many_`).
    """
    params = [p for p in parameters if p.requires_grad]
    if mesh is None or mesh.world_size == 1:
        return
    fill_missing_grads(params)
    for group in (mesh.sp_group, mesh.dp_group):
        comm.all_reduce_many_([p.grad for p in params], group, device=mesh.comm_device)


def global_loss(loss_share: torch.Tensor, mesh: SequenceParallelMesh | None) -> torch.Tensor:
    """The true loss value (for logging): the detached sum of every rank's share over sp x dp."""
    t = _upcast(loss_share.detach().clone())
    if mesh is not None and mesh.world_size > 1:
        t = t.to(mesh.comm_device)
        comm.all_reduce_(t, mesh.sp_group, device=mesh.comm_device)
        comm.all_reduce_(t, mesh.dp_group, device=mesh.comm_device)
    return t


# ----------------------------------------------------------------------------- per-token NLL
def _check_inputs(
    logits: torch.Tensor | None, hidden: torch.Tensor | None, lm_head: Callable | None, labels: torch.Tensor
) -> None:
    if (logits is None) == (hidden is None):
        raise SeqParError("give exactly one of logits or hidden= (with lm_head=) to compute the loss")
    if hidden is not None and lm_head is None:
        raise SeqParError("hidden= needs lm_head= (a callable hidden -> logits, e.g. model.lm_head)")
    x = logits if logits is not None else hidden
    if labels.dim() != 2 or x.dim() != 3 or tuple(x.shape[:2]) != tuple(labels.shape):
        name = "logits" if logits is not None else "hidden"
        raise SeqParError(
            f"{name} must be [B, S_local, *] and shift_labels [B, S_local] with the same B, S_local; got "
            f"{tuple(x.shape)} and {tuple(labels.shape)} (use the collator's 'shift_labels' for this rank)"
        )
    if labels.dtype.is_floating_point:
        raise SeqParError(f"shift_labels must be integer, got {labels.dtype}")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 for the softmax; fp32/fp64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


@torch.no_grad()
def _metric_stats(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[n, 3] detached TOKEN_METRICS of fp32 logits [n, V] and targets [n]; one [n, V] temporary."""
    z = logits.detach()
    lse = torch.logsumexp(z, dim=-1)
    p = (z - lse[:, None]).exp_()
    ent = lse - p.mul_(z).sum(-1)  # log Z - E_p[z], TRL's formula
    del p
    top1 = (z.argmax(dim=-1) == y).to(z.dtype)
    return torch.stack([ent, top1, z.mean(dim=-1)], dim=1)


def _chunk_stats(
    h: torch.Tensor, y: torch.Tensor, lm_head: Callable, transform: Callable | None, temperature: float, entropy: bool,
    sink: list | None = None,
) -> torch.Tensor:
    """[n, 1] NLL of the targets, or [n, 2] NLL and entropy, of one chunk's (temperature-scaled) softmax.

    sink: an empty list gets the chunk's detached TOKEN_METRICS [n, 3], once: the checkpoint's backward
    recompute finds it filled and skips them (no gradient, no second pass over the logits)."""
    logits = lm_head(h)
    if transform is not None:  # e.g. Gemma's final-logit softcap, in the head's dtype as the model does it
        logits = transform(logits)
    logits = _upcast(logits)
    if temperature != 1.0:  # after the model's own transform, in fp32 (as RL samplers scale logits)
        logits = logits / temperature
    if sink is not None and not sink:
        sink.append(_metric_stats(logits, y))
    if not entropy:
        return F.cross_entropy(logits, y, reduction="none")[:, None]
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(1, y[:, None])
    return torch.cat([nll, -(logp.exp() * logp).sum(-1, keepdim=True)], dim=1)


def chunked_token_stats(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
    ignore_index: int = IGNORE_INDEX,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    metrics: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token NLL [B, S_local], per-token entropy [B, S_local] or None) from hidden states [B, S_local, H],
    never holding more than one chunk's logits.

    Only supervised tokens get logits, `chunk_size` of them at a time; under autograd each chunk is
    checkpointed, so at most one chunk's [chunk_size, V] logits are alive, in forward and in backward.
    transform: applied to each chunk's lm_head output (post-lm_head logit processing such as
    softcapping); then the fp32 logits are divided by `temperature`. entropy=True also returns the
    entropy of that distribution (differentiable). fp32 results (fp64 for fp64 inputs); 0 where not
    supervised.
    metrics: a dict that gets the detached TOKEN_METRICS, each [B, S_local] (0 where not supervised), from
    the same chunks' logits, without gradient and computed once per chunk (not again in the backward
    recompute): for logging (TRL's entropy / mean_token_accuracy / logits metrics).
    """
    if chunk_size < 1:
        raise SeqParError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise SeqParError(f"temperature must be > 0, got {temperature}")
    labels = labels.to(hidden.device).long()
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    idx = torch.nonzero(y != ignore_index).reshape(-1)
    if idx.numel() == 0:
        zero = _upcast(lm_head(h[:1])).sum() * 0.0  # keeps every parameter in the graph
        out = zero + torch.zeros(labels.shape, dtype=zero.dtype, device=h.device)
        if metrics is not None:
            metrics.update({k: torch.zeros_like(out).detach() for k in TOKEN_METRICS})
        return out, (out.clone() if entropy else None)
    hs, ys = h.index_select(0, idx), y.index_select(0, idx)
    grad = torch.is_grad_enabled()
    starts = range(0, idx.numel(), chunk_size)
    sinks = [[] if metrics is not None else None for _ in starts]
    parts = [
        checkpoint(_chunk_stats, hs[i : i + chunk_size], ys[i : i + chunk_size], lm_head, transform, temperature,
                   entropy, sink, use_reentrant=False)
        if grad
        else _chunk_stats(hs[i : i + chunk_size], ys[i : i + chunk_size], lm_head, transform, temperature, entropy,
                          sink)
        for i, sink in zip(starts, sinks)
    ]
    stats = torch.cat(parts)
    out = torch.zeros(y.numel(), stats.shape[1], dtype=stats.dtype, device=stats.device).index_add(0, idx, stats)
    nll = out[:, 0].reshape(labels.shape)
    if metrics is not None:
        _scatter_metrics(metrics, torch.cat([s[0] for s in sinks]), idx, labels.shape)
    return nll, (out[:, 1].reshape(labels.shape) if entropy else None)


def _scatter_metrics(metrics: dict, per_target: torch.Tensor, idx: torch.Tensor, shape: torch.Size) -> None:
    """Per-target TOKEN_METRICS [n, 3] at flat positions idx -> metrics[name] [shape], 0 elsewhere."""
    full = torch.zeros(math.prod(shape), per_target.shape[1], dtype=per_target.dtype, device=per_target.device)
    full.index_copy_(0, idx.to(per_target.device), per_target)
    metrics.update({k: full[:, j].reshape(shape) for j, k in enumerate(TOKEN_METRICS)})


@torch.no_grad()
def token_metric_stats(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, torch.Tensor]:
    """The detached TOKEN_METRICS ({name: [B, S_local]}, 0 where not supervised) from full logits
    [B, S_local, V]: the full-logits counterpart of `chunked_token_stats(metrics=)`. Supervised positions go
    `chunk_tokens` at a time (None: one chunk's fp32 temporaries <= 256 MB), so the cost on top of the logits
    is one chunk, not another [B, S_local, V]."""
    _check_inputs(logits, None, None, shift_labels)
    labels = shift_labels.to(logits.device).long()
    y = labels.reshape(-1)
    idx = torch.nonzero(y != ignore_index).reshape(-1)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    step = chunk_tokens or max(1, (256 * 2**20) // (4 * logits.shape[-1]))
    parts = []
    for i in range(0, idx.numel(), step):
        rows = idx[i : i + step]
        z = _upcast(flat.index_select(0, rows))
        parts.append(_metric_stats(z / temperature if temperature != 1.0 else z, y.index_select(0, rows)))
    per_target = torch.cat(parts) if parts else torch.zeros(0, len(TOKEN_METRICS), device=logits.device)
    out: dict[str, torch.Tensor] = {}
    _scatter_metrics(out, per_target, idx, labels.shape)
    return out


def chunked_token_nll(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    chunk_size: int,
    ignore_index: int = IGNORE_INDEX,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-token NLL [B, S_local] from hidden states [B, S_local, H] (`chunked_token_stats` without entropy)."""
    return chunked_token_stats(hidden, labels, lm_head, chunk_size, ignore_index, transform)[0]


def _token_nll(
    logits: torch.Tensor | None,
    labels: torch.Tensor,
    hidden: torch.Tensor | None,
    lm_head: Callable | None,
    chunk_size: int,
    ignore_index: int,
) -> torch.Tensor:
    """Per-token negative log-likelihood [B, S_local] (fp32, or fp64 for fp64); 0 where not supervised.

    Always connected to the graph of the inputs (and of lm_head's parameters), even with no
    supervised token, so backward gives zero -- not missing -- gradients on every rank.
    """
    if logits is None:
        return chunked_token_nll(hidden, labels, lm_head, chunk_size, ignore_index)
    labels = labels.to(logits.device).long()
    flat_logits = _upcast(logits.reshape(-1, logits.shape[-1]))
    flat = F.cross_entropy(flat_logits, labels.reshape(-1), ignore_index=ignore_index, reduction="none")
    return flat.view_as(labels)


def token_nll(logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token NLL [B, S_local] (fp32) from full logits [B, S_local, V]; 0 where not supervised."""
    _check_inputs(logits, None, None, shift_labels)
    return _token_nll(logits, shift_labels, None, None, 1, ignore_index)


def token_logprob_stats(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full-logits counterpart of `chunked_token_stats`: (NLL, entropy or None) [B, S_local] of
    softmax(logits / temperature) from logits [B, S_local, V]; 0 where not supervised."""
    _check_inputs(logits, None, None, shift_labels)
    if not temperature > 0:
        raise SeqParError(f"temperature must be > 0, got {temperature}")
    labels = shift_labels.to(logits.device).long()
    keep = labels != ignore_index
    logp = torch.log_softmax(_upcast(logits) / temperature, dim=-1)
    tok = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    nll = torch.where(keep, -tok, torch.zeros_like(tok))
    if not entropy:
        return nll, None
    ent = -(logp.exp() * logp).sum(-1)
    return nll, torch.where(keep, ent, torch.zeros_like(ent))


# ----------------------------------------------------------------------------- SFT
def sft_loss(
    logits: torch.Tensor | None,
    shift_labels: torch.Tensor,
    num_items: torch.Tensor | int | None,
    *,
    hidden: torch.Tensor | None = None,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    chunk_size: int = 1024,
    mesh: SequenceParallelMesh | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """This rank's share of the token-mean cross-entropy: sum of CE over local tokens / num_items.

    logits: [B, S_local, V] for this rank's shard, or None with hidden=[B, S_local, H] and lm_head
    (chunked CE, `chunk_size` supervised tokens per chunk, full logits never materialised).
    shift_labels: the collator's [B, S_local] targets (ignore_index = not supervised).
    num_items: the GLOBAL supervised-token count of the optimizer step: the collator's
    "num_supervised_tokens" summed over every grad-accumulation micro-batch, then over dp with
    `global_token_count` (SP ranks share it). None: use this micro-batch only, counted over sp x dp
    from shift_labels (needs mesh; one extra all-reduce).
    Zero supervised tokens (on this rank or anywhere) give a finite 0 and zero gradients.
    Gradients: SUM over dp x sp ranks (see the module docstring and `gradient_reduction_factor`).
    """
    _check_inputs(logits, hidden, lm_head, shift_labels)
    nll = _token_nll(logits, shift_labels, hidden, lm_head, chunk_size, ignore_index)
    return sft_loss_from_nll(nll, shift_labels, num_items, mesh=mesh, ignore_index=ignore_index)


def sft_loss_from_nll(
    nll: torch.Tensor,
    shift_labels: torch.Tensor,
    num_items: torch.Tensor | int | None,
    *,
    mesh: SequenceParallelMesh | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """`sft_loss` from a per-token NLL [B, S_local] (0 where not supervised), e.g. the fused head's."""
    if num_items is None:
        if mesh is None:
            raise SeqParError("num_items=None needs mesh= to count supervised tokens over sp x dp")
        local = (shift_labels.to(nll.device) != ignore_index).sum()
        num_items = global_loss(local, mesh)  # sum over sp and dp
    denom = torch.as_tensor(num_items, device=nll.device).detach().to(nll.dtype).clamp(min=1.0)
    return nll.sum() / denom


# ----------------------------------------------------------------------------- DPO family
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
    _check_inputs(logits, hidden, lm_head, shift_labels)
    nll = _token_nll(logits, shift_labels, hidden, lm_head, chunk_size, ignore_index)
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
    pc, pr = _upcast(policy_chosen), _upcast(policy_rejected)
    if loss_type != "simpo":
        rc, rr = _upcast(ref_chosen.detach()).to(pc.dtype), _upcast(ref_rejected.detach()).to(pc.dtype)
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
        "logps/chosen": _upcast(policy_chosen.detach()).mean(),
        "logps/rejected": _upcast(policy_rejected.detach()).mean(),
    }
    return share, metrics
