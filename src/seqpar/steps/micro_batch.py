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
import torch.distributed as dist

from .. import comm
from .. import loss as L
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .forward import forward_nll, forward_token_stats

__all__ = ["StepSpec", "count_items", "micro_batch_loss", "sft_metric_sums"]


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
    # GRPO importance sampling against the sampler's log-probs batch["rollout_logps"] (TRL's
    # vllm_importance_sampling_correction: token/sequence level, truncate/mask, bounds); None = off
    importance: L.ImportanceSampling | None = None
    # GRPO, one rollout over several steps: a batch without "old_logps" keeps this forward's detached log-probs as
    # its "old_logps" (its first pass: the policy has not moved since it sampled), for the passes after it
    keep_old_logps: bool = False
    # SFT / DPO: also return the sums TRL's logged metrics are made of (micro_batch_loss, "shard_sums" /
    # "batch_sums"); computed without gradient from the same forward (the fused head's chunks).
    metric_sums: bool = False


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
    """micro_batch_loss for stage "grpo": batch["advantages"] [B], optional "old_logps" / "ref_logps" /
    "rollout_logps" (the sampler's; the mismatch metrics, and importance sampling with spec.importance) [B, S_local]."""
    den = num_items if isinstance(num_items, L.GRPODenominators) else L.GRPODenominators.from_counts(
        num_items, spec.max_completion_length)
    if batch.get("advantages") is None:
        raise SeqParError("GRPO batches need 'advantages' (one float per row, the same on every SP rank)")
    if batch.get("cu_seqlens") is not None:
        raise SeqParError("GRPO needs one completion per row (one advantage per row): collate with packing=False")
    sampling = batch.get("rollout_logps")
    if spec.importance is not None and sampling is None:
        raise SeqParError("GRPO importance sampling (StepSpec.importance) needs the sampler's per-token "
                          "log-probs as batch['rollout_logps'] [B, S_local]: give them, or turn the correction off")
    ref = batch.get("ref_logps")
    if spec.beta != 0 and ref is None:
        if reference is None:
            raise SeqParError(f"GRPO beta={spec.beta} needs reference log-probs: give a reference model, "
                              "batch['ref_logps'] [B, S_local], or set beta: 0")
        ref = reference(batch)
    nll, ent, labels = forward_token_stats(model, batch, spec.fused_loss, spec.loss_chunk_tokens,
                                           temperature=spec.temperature, entropy=True)
    old = batch.get("old_logps")
    if old is None and spec.keep_old_logps:
        batch["old_logps"] = (-nll).detach()  # what a no-grad forward now would give: the same weights and path
    share, met = L.grpo_loss(
        -nll, batch["advantages"], labels, den, old_logps=None if old is None else old.to(nll.device),
        ref_logps=None if spec.beta == 0 else ref.to(nll.device), beta=spec.beta, epsilon_low=spec.epsilon_low,
        epsilon_high=spec.epsilon_high, loss_type=spec.loss_type, mesh=mesh, entropy=ent,
        kl_ratio_correction=spec.kl_ratio_correction, importance=spec.importance,
        sampling_logps=None if spec.importance is None else sampling.to(nll.device),
    )
    if sampling is not None:  # the sampler vs the trainer at the rollout (the old log-probs, as TRL's metric)
        at_rollout = -nll.detach() if old is None else old.to(nll.device)
        met.update(_rollout_diff(at_rollout, sampling.to(nll.device), labels, mesh))
    return share, met


def _rollout_diff(logps: torch.Tensor, rollout: torch.Tensor, labels: torch.Tensor,
                  mesh: SequenceParallelMesh) -> dict[str, torch.Tensor]:
    """|trainer log-prob - sampler log-prob| over the micro-batch's completion tokens (every rank): the max, and
    the sum and count `train_step` turns into the step's mean (rollout_logprob_diff_mean)."""
    mask = labels != L.IGNORE_INDEX
    d = (logps.float() - rollout.float()).abs()[mask]
    sums = torch.stack([d.sum(), mask.sum().to(d.dtype)]).double()
    top = d.max().double().reshape(1) if d.numel() else torch.zeros(1, dtype=torch.float64)
    for group, size in ((mesh.sp_group, mesh.sp_size), (mesh.dp_group, mesh.dp_size)):
        if size > 1:
            sums = comm.all_reduce_values(sums, group, mesh.comm_device)
            top = comm.all_reduce_values(top, group, mesh.comm_device, op=dist.ReduceOp.MAX)
    return {"rollout_logprob_diff_max": top[0], "rollout_logprob_diff_sum": sums[0],
            "rollout_logprob_diff_count": sums[1]}


def _dpo_reference(
    batch: dict[str, torch.Tensor], spec: StepSpec, reference: Callable[[dict[str, torch.Tensor]], Any] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The reference log-prob sums (chosen [B], rejected [B]): precomputed in the batch, or `reference(batch)`;
    (None, None) for SimPO."""
    if spec.loss_type == "simpo":
        return None, None
    rows = batch["shift_labels"].shape[0]
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
    return ref_logps[:n], ref_logps[n:]


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

    spec.metric_sums (SFT / DPO): the metrics also hold "shard_sums" and "batch_sums", dicts of 0-dim float64
    sums (see `sft_metric_sums` / `_dpo_sums`) from which seqpar.trl computes TRL's logged metrics; the per-token
    statistics come from the same forward without gradient, so the loss and its gradient are unchanged.
    """
    if spec.stage == "grpo":
        return _grpo_loss(model, batch, num_items, mesh, spec, reference)
    tok: dict[str, torch.Tensor] | None = {} if spec.metric_sums else None
    if spec.stage == "sft":
        nll, labels = forward_nll(model, batch, spec.fused_loss, spec.loss_chunk_tokens, metrics=tok)
        share = L.sft_loss_from_nll(nll, labels, num_items, mesh=mesh)
        return share, ({} if tok is None else sft_metric_sums(tok, labels, batch))
    ref_c, ref_r = _dpo_reference(batch, spec, reference)
    nll, labels = forward_nll(model, batch, spec.fused_loss, spec.loss_chunk_tokens, metrics=tok)
    logps, counts = L.sequence_logps_from_nll(nll, labels, mesh)
    n = logps.shape[0] // 2
    if ref_c is not None:
        ref_c = ref_c.to(logps.device, logps.dtype)
        ref_r = ref_r.to(logps.device, logps.dtype)
    share, metrics = L.dpo_loss(
        logps[:n], logps[n:], ref_c, ref_r, beta=spec.beta, loss_type=spec.loss_type,
        chosen_counts=counts[:n], rejected_counts=counts[n:], gamma=spec.gamma, mesh=mesh, num_pairs=num_items,
    )
    if tok is not None:
        metrics.update(_dpo_sums(tok, labels, batch, logps.detach(), ref_c, ref_r, spec.beta))
    return share, metrics


# ----------------------------------------------------------------------------- metric sums (StepSpec.metric_sums)
# "shard_sums": over THIS rank's positions (sum them over sp and dp); "batch_sums": of the micro-batch's rows,
# identical on the SP ranks of a group (sum them over dp only). 0-dim float64 tensors, detached; TRL's metric
# of a micro-batch is then a ratio of global sums (seqpar.trl.trainer).
def _sum(x: torch.Tensor) -> torch.Tensor:
    return x.detach().double().sum()


def sft_metric_sums(tok: dict[str, torch.Tensor], labels: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict:
    """TRL SFT: entropy and top-1 hits over the supervised (shifted) targets, their count; the input tokens.
    tok: the per-token seqpar.loss.TOKEN_METRICS (fused head's chunks or `L.token_metric_stats` of logits)."""
    mask = labels != L.IGNORE_INDEX
    shard = {"entropy": _sum(tok["entropy"]), "top1": _sum(tok["is_top1"]), "tokens": _sum(mask)}
    return {"shard_sums": shard, "batch_sums": {"input_tokens": _input_tokens(batch, mask.device)}}


def _input_tokens(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The full batch's real (unpadded) input tokens: TRL's attention_mask sum (padding-free: the row length)."""
    return torch.as_tensor(batch["num_input_tokens"]).to(device).double()


def _dpo_sums(tok: dict[str, torch.Tensor], labels: torch.Tensor, batch: dict[str, torch.Tensor],
              logps: torch.Tensor, ref_c: torch.Tensor | None, ref_r: torch.Tensor | None, beta: float) -> dict:
    """TRL DPO: entropy over every completion token; logits/* (mean logit) per side; top-1 hits on the chosen
    side; per pair the rewards beta * (logps - ref_logps) of the SUMMED log-probs (for IPO too, as TRL logs
    them), their accuracy / margin and the policy log-probs. Rows are [chosen..., rejected...]."""
    mask = labels != L.IGNORE_INDEX
    n = mask.shape[0] // 2
    ch, rj = mask[:n], mask[n:]
    shard = {
        "entropy": _sum(tok["entropy"]), "tokens": _sum(mask),
        "chosen_logits": _sum(tok["mean_logits"][:n]), "chosen_tokens": _sum(ch),
        "rejected_logits": _sum(tok["mean_logits"][n:]), "rejected_tokens": _sum(rj),
        "chosen_top1": _sum(tok["is_top1"][:n]),
    }
    pc, pr = logps[:n], logps[n:]
    rows = {"pairs": torch.tensor(float(n), dtype=torch.float64, device=pc.device),
            "input_tokens": _input_tokens(batch, pc.device)}
    if ref_c is not None:  # in the log-probs' dtype, as TRL compares them
        cr, rr = beta * (pc - ref_c), beta * (pr - ref_r)
        rows.update({"rewards_chosen": _sum(cr), "rewards_rejected": _sum(rr), "rewards_accuracies": _sum(cr > rr),
                     "rewards_margins": _sum(cr - rr)})
    rows.update({"logps_chosen": _sum(pc), "logps_rejected": _sum(pr)})
    return {"shard_sums": shard, "batch_sums": rows}
