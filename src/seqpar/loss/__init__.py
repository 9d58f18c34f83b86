"""Losses for sequence-parallel training: token-normalised SFT cross-entropy, DPO/IPO/SimPO, and the
GRPO family. This package only re-exports; each part lives in a module of its own:

    nll.py        per-token NLL: full logits or chunked through the lm_head, entropy, logging metrics
    counts.py     global_token_count, gradient_reduction_factor, sum_gradients, global_loss
    sft.py        sft_loss (token-mean CE share), sft_loss_from_nll
    dpo.py        sequence_logps, dpo_loss (DPO / IPO / SimPO)
    grpo.py       grpo_loss (GRPO / BNPO / Dr. GRPO) and its step denominators
    importance.py ImportanceSampling: TRL's vLLM importance-sampling correction (token/sequence, truncate/mask)
    grad_sync.py  OverlappedGradSum: the gradient sums of sum_gradients, posted during backward

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

from .counts import global_loss, global_token_count, gradient_reduction_factor, sum_gradients
from .dpo import DPO_LOSS_TYPES, dpo_loss, sequence_logps, sequence_logps_from_nll
from .grad_sync import OverlappedGradSum
from .grpo import GRPO_LOSS_TYPES, GRPODenominators, grpo_denominators, grpo_local_counts, grpo_loss
from .importance import IMPORTANCE_MODES, ImportanceSampling, importance_weight
from .nll import (
    IGNORE_INDEX,
    TOKEN_METRICS,
    chunked_token_nll,
    chunked_token_stats,
    token_logprob_stats,
    token_metric_stats,
    token_nll,
)
from .sft import sft_loss, sft_loss_from_nll

__all__ = [
    "IMPORTANCE_MODES",
    "ImportanceSampling",
    "importance_weight",
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
