"""Per-token negative log-likelihoods of a shard's targets: from full logits, or chunked from hidden states
through the lm_head (`chunked_token_stats`: one chunk's logits alive at a time, forward and backward), with the
entropy and the detached logging metrics (TOKEN_METRICS) of the same chunks. No collectives here: the losses
built on them (sft.py, dpo.py, grpo.py) do the reductions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import SeqParError

__all__ = ["IGNORE_INDEX", "TOKEN_METRICS", "upcast", "check_inputs", "per_token_nll", "chunked_token_stats",
           "chunked_token_nll", "token_nll", "token_logprob_stats", "token_metric_stats"]

IGNORE_INDEX = -100
# Detached per-token statistics for logging (`chunked_token_stats(metrics=)`, `token_metric_stats`), TRL's
# definitions: the entropy of the next-token distribution, 1.0 where the target is its argmax (the FIRST maximum,
# as torch.argmax: a tie with an earlier token is not a hit), and the mean logit over the vocabulary.
TOKEN_METRICS = ("entropy", "is_top1", "mean_logits")


def check_inputs(
    logits: torch.Tensor | None, hidden: torch.Tensor | None, lm_head: Callable | None, labels: torch.Tensor
) -> None:
    """SeqParError unless exactly one of logits [B, S_local, V] / hidden [B, S_local, H] (with lm_head) matches
    the integer shift_labels [B, S_local]."""
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


def upcast(x: torch.Tensor) -> torch.Tensor:
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
    logits = upcast(logits)
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
        zero = upcast(lm_head(h[:1])).sum() * 0.0  # keeps every parameter in the graph
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
    check_inputs(logits, None, None, shift_labels)
    labels = shift_labels.to(logits.device).long()
    y = labels.reshape(-1)
    idx = torch.nonzero(y != ignore_index).reshape(-1)
    flat = logits.detach().reshape(-1, logits.shape[-1])
    step = chunk_tokens or max(1, (256 * 2**20) // (4 * logits.shape[-1]))
    parts = []
    for i in range(0, idx.numel(), step):
        rows = idx[i : i + step]
        z = upcast(flat.index_select(0, rows))
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


def per_token_nll(
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
    flat_logits = upcast(logits.reshape(-1, logits.shape[-1]))
    flat = F.cross_entropy(flat_logits, labels.reshape(-1), ignore_index=ignore_index, reduction="none")
    return flat.view_as(labels)


def token_nll(logits: torch.Tensor, shift_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token NLL [B, S_local] (fp32) from full logits [B, S_local, V]; 0 where not supervised."""
    check_inputs(logits, None, None, shift_labels)
    return per_token_nll(logits, shift_labels, None, None, 1, ignore_index)


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
    check_inputs(logits, None, None, shift_labels)
    if not temperature > 0:
        raise SeqParError(f"temperature must be > 0, got {temperature}")
    labels = shift_labels.to(logits.device).long()
    keep = labels != ignore_index
    logp = torch.log_softmax(upcast(logits) / temperature, dim=-1)
    tok = logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    nll = torch.where(keep, -tok, torch.zeros_like(tok))
    if not entropy:
        return nll, None
    ent = -(logp.exp() * logp).sum(-1)
    return nll, torch.where(keep, ent, torch.zeros_like(ent))
