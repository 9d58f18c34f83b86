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
from ..memory.fused_loss import fused_targets
from ..mesh import SequenceParallelMesh

__all__ = ["StepSpec", "count_items", "model_inputs", "forward_logits", "forward_nll", "forward_token_stats",
           "micro_batch_loss", "ReferenceLogps", "ReferenceTokenLogps"]


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


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device | str | None = None,
                 model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Keyword arguments for a model patched by seqpar.hf.apply_sequence_parallel.

    position_ids are GLOBAL (RoPE must not restart per shard); cu_seqlens (packing) are the FULL
    sequence's document boundaries, passed through to the SP attention. A vision-language batch
    (train.images.VisionCollator: the full input ids and the images) goes through
    seqpar.hf.sp_vlm_inputs, which needs the model.
    """
    if batch.get("full_input_ids") is not None:
        from ..hf.vision import sp_vlm_inputs

        if model is None:
            raise SeqParError("a vision-language batch needs the model: model_inputs(batch, device, model)")
        move = (lambda t: t.to(device)) if device is not None else (lambda t: t)  # noqa: E731
        pixels = batch.get("pixel_values")
        kw = sp_vlm_inputs(model, None, move(batch["full_input_ids"]),
                           pixel_values=move(pixels) if pixels is not None else None,
                           image_grid_thw=batch.get("image_grid_thw"))
        return {**kw, "use_cache": False}
    kw: dict[str, Any] = {
        "input_ids": batch["input_ids"].to(device) if device is not None else batch["input_ids"],
        "position_ids": batch["position_ids"].to(device) if device is not None else batch["position_ids"],
        "use_cache": False,
    }
    if batch.get("cu_seqlens") is not None:
        kw["cu_seqlens"] = batch["cu_seqlens"]
    return kw


def forward_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(**model_inputs(batch, device, model)).logits


def forward_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor], fused: bool = True,
                chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token NLL [B, S_local] fp32, shift_labels on its device): fused chunked head, or full logits."""
    nll, _, labels = forward_token_stats(model, batch, fused, chunk_tokens)
    return nll, labels


def forward_token_stats(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], fused: bool = True, chunk_tokens: int | None = None,
    *, temperature: float = 1.0, entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(per-token NLL, per-token entropy or None, shift_labels on the model's device) of softmax(logits / T),
    [B, S_local] fp32, 0 where not supervised: fused chunked head, or full logits."""
    device = next(model.parameters()).device
    labels = batch["shift_labels"].to(device)
    if not fused:
        logits = model(**model_inputs(batch, device, model)).logits
        if temperature == 1.0 and not entropy:
            return L.token_nll(logits, labels), None, labels
        nll, ent = L.token_logprob_stats(logits, labels, temperature=temperature, entropy=entropy)
        return nll, ent, labels
    with fused_targets(model, labels, chunk_tokens, temperature=temperature, entropy=entropy) as request:
        out = model(**model_inputs(batch, device, model))
    return request.result(out), (request.entropy_result(out) if entropy else None), labels


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
