"""The pieces of one optimizer step under SP, shared by the plain loop and the HF Trainer drop-ins.

One step = several micro-batches (grad accumulation). The loss denominator is the GLOBAL count
of the step (supervised tokens for SFT, pairs for DPO, [sequences, completion tokens] for GRPO),
summed over all micro-batches first and
then over dp (`seqpar.loss.global_token_count`; SP ranks of a group already share it). Each
micro-batch backpropagates its share (seqpar.loss convention); gradients are then SUMMED over
dp x sp: by `seqpar.loss.sum_gradients`, or by FSDP (which averages, hence the loss factor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import loss as L
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .forward import forward_nll, forward_token_stats

__all__ = ["StepSpec", "count_items", "micro_batch_loss"]


@dataclass
class StepSpec:
    stage: str = "sft"  # "sft" | "dpo" | "grpo"
    beta: float = 0.1  # DPO beta; for "grpo" the KL coefficient (0: no reference model)
    loss_type: str = "sigmoid"
    gamma: float = 0.5
    # Fused chunked lm_head + loss (seqpar.memory.fused_loss): no [S_local, vocab] logits; off = full logits.
    fused_loss: bool = True
    loss_chunk_tokens: int | None = None  # None: as many as keep one chunk's fp32 logits <= 256 MB
    # GRPO (seqpar.loss.grpo; loss_type "grpo" | "bnpo" | "dr_grpo"): clip range, dr_grpo's length, sampling T
    epsilon_low: float = 0.2
    epsilon_high: float | None = None  # None: epsilon_low
    max_completion_length: int | None = None
    temperature: float = 1.0
    kl_ratio_correction: bool = False  # GRPO: k3 KL x importance ratio (TRL's use_bias_correction_kl)


def count_items(micro_batches: Sequence[dict[str, torch.Tensor]], stage: str) -> torch.Tensor:
    """This dp rank's loss denominator over all micro-batches of the step (not yet reduced over dp).

    "grpo": a long tensor [num_sequences, num_tokens] (`seqpar.loss.grpo_local_counts`); after
    `global_token_count` it is what `micro_batch_loss` takes (or pass `grpo_denominators(...)`)."""
    if stage == "grpo":
        return L.grpo_local_counts(micro_batches)
    key = "num_pairs" if stage == "dpo" else "num_supervised_tokens"
    return torch.stack([torch.as_tensor(b[key]).long() for b in micro_batches]).sum()


def _grpo_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], num_items: Any, mesh: SequenceParallelMesh,
    spec: StepSpec, reference: Callable[[dict[str, torch.Tensor]], Any] | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """micro_batch_loss for stage "grpo": batch["advantages"] [B], optional "old_logps"/"ref_logps" [B, S_local]."""
    den = num_items if isinstance(num_items, L.GRPODenominators) else L.GRPODenominators.from_counts(
        num_items, spec.max_completion_length)
    if batch.get("advantages") is None:
        raise SeqParError("GRPO batches need 'advantages' (one float per row, the same on every SP rank)")
    if batch.get("cu_seqlens") is not None:
        raise SeqParError("GRPO needs one completion per row (one advantage per row): collate with packing=False")
    ref = batch.get("ref_logps")
    if spec.beta != 0 and ref is None:
        if reference is None:
            raise SeqParError(f"GRPO beta={spec.beta} needs reference log-probs: give a reference model, "
                              "batch['ref_logps'] [B, S_local], or set beta: 0")
        ref = reference(batch)
    nll, ent, labels = forward_token_stats(model, batch, spec.fused_loss, spec.loss_chunk_tokens,
                                           temperature=spec.temperature, entropy=True)
    old = batch.get("old_logps")
    return L.grpo_loss(
        -nll, batch["advantages"], labels, den, old_logps=None if old is None else old.to(nll.device),
        ref_logps=None if spec.beta == 0 else ref.to(nll.device), beta=spec.beta, epsilon_low=spec.epsilon_low,
        epsilon_high=spec.epsilon_high, loss_type=spec.loss_type, mesh=mesh, entropy=ent,
        kl_ratio_correction=spec.kl_ratio_correction,
    )


def micro_batch_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    num_items: torch.Tensor,
    mesh: SequenceParallelMesh,
    spec: StepSpec,
    reference: Callable[[dict[str, torch.Tensor]], Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss_share, detached metrics) of one micro-batch; num_items = the step's global denominator.

    DPO reference log-probs: a batch with "ref_logps" (precomputed per-sequence sums, float [2B] in
    the batch's [chosen..., rejected...] order; `SequenceParallelDPOCollator`) uses them and does NOT
    call `reference` even when one is given (the trainers always build one; the precomputed values
    are the reason to skip that forward). Otherwise `reference(batch)` runs. SimPO uses neither.

    GRPO (`_grpo_loss`): num_items = `count_items(..., "grpo")` reduced with `global_token_count`, or
    a `seqpar.loss.GRPODenominators`; `reference(batch)` (a `ReferenceTokenLogps`) runs only when
    beta != 0 and the batch carries no per-token "ref_logps".
    """
    if spec.stage == "grpo":
        return _grpo_loss(model, batch, num_items, mesh, spec, reference)
    if spec.stage == "sft":
        nll, labels = forward_nll(model, batch, spec.fused_loss, spec.loss_chunk_tokens)
        return L.sft_loss_from_nll(nll, labels, num_items, mesh=mesh), {}
    ref_c = ref_r = None
    rows = batch["shift_labels"].shape[0]
    if spec.loss_type != "simpo":
        if batch.get("ref_logps") is not None:
            ref_logps = torch.as_tensor(batch["ref_logps"]).detach()
            if ref_logps.shape != (rows,):
                raise SeqParError(
                    f"batch['ref_logps'] has shape {tuple(ref_logps.shape)}, expected ({rows},) (one sum per "
                    f"row, [chosen..., rejected...]): build the batch with SequenceParallelDPOCollator"
                )
        elif reference is None:
            raise SeqParError(
                f"DPO loss_type={spec.loss_type!r} needs reference log-probs: give a reference model, or rows "
                f"with precomputed ref_chosen_logps/ref_rejected_logps"
            )
        else:
            ref_logps, _ = reference(batch)
        n = rows // 2
        ref_c, ref_r = ref_logps[:n], ref_logps[n:]
    nll, labels = forward_nll(model, batch, spec.fused_loss, spec.loss_chunk_tokens)
    logps, counts = L.sequence_logps_from_nll(nll, labels, mesh)
    n = logps.shape[0] // 2
    if ref_c is not None:
        ref_c = ref_c.to(logps.device, logps.dtype)
        ref_r = ref_r.to(logps.device, logps.dtype)
    share, metrics = L.dpo_loss(
        logps[:n], logps[n:], ref_c, ref_r, beta=spec.beta, loss_type=spec.loss_type,
        chosen_counts=counts[:n], rejected_counts=counts[n:], gamma=spec.gamma, mesh=mesh, num_pairs=num_items,
    )
    return share, metrics
