"""One forward of a model patched by seqpar.hf.apply_sequence_parallel, from a collated batch.

`model_inputs` turns a collator's shard into the model's keyword arguments (global position ids,
packed-document boundaries; a vision batch through the model's own hook); `forward_token_stats` runs
the model and returns per-token NLL (and entropy) of the supervised tokens, through the fused chunked
head (seqpar.memory.fused_loss) or the full logits.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import loss as L
from ..errors import SeqParError
from ..memory.fused_loss import fused_targets
from ..unwrap import BATCH_INPUTS_HOOK, unwrapped_base

__all__ = ["model_inputs", "forward_logits", "forward_nll", "forward_token_stats"]


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device | str | None = None,
                 model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Keyword arguments for a model patched by seqpar.hf.apply_sequence_parallel.

    position_ids are GLOBAL (RoPE must not restart per shard); cu_seqlens (packing) are the FULL
    sequence's document boundaries, passed through to the SP attention. A batch that only the model can
    shard (a vision-language batch, train.dataset.images.VisionCollator: the full input ids and the images)
    goes through the hook apply_sequence_parallel installed on the model (seqpar.unwrap.BATCH_INPUTS_HOOK).
    """
    if batch.get("full_input_ids") is not None:
        if model is None:
            raise SeqParError("a vision-language batch needs the model: model_inputs(batch, device, model)")
        hook = getattr(unwrapped_base(model), BATCH_INPUTS_HOOK, None)
        if hook is None:
            raise SeqParError("sp_vlm_inputs needs a Qwen VL model with apply_sequence_parallel(model, mesh) applied")
        return hook(model, batch, device)
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
                chunk_tokens: int | None = None, *,
                metrics: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token NLL [B, S_local] fp32, shift_labels on its device): fused chunked head, or full logits.
    metrics: as forward_token_stats."""
    nll, _, labels = forward_token_stats(model, batch, fused, chunk_tokens, metrics=metrics)
    return nll, labels


def forward_token_stats(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], fused: bool = True, chunk_tokens: int | None = None,
    *, temperature: float = 1.0, entropy: bool = False, metrics: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(per-token NLL, per-token entropy or None, shift_labels on the model's device) of softmax(logits / T),
    [B, S_local] fp32, 0 where not supervised: fused chunked head, or full logits.

    metrics: a dict that gets the detached per-token seqpar.loss.TOKEN_METRICS of the same distribution
    (entropy, is_top1, mean_logits; [B, S_local], 0 where not supervised), for logging: from the fused head's
    chunks (computed once, without gradient), or from the full logits `chunk_tokens` positions at a time."""
    device = next(model.parameters()).device
    labels = batch["shift_labels"].to(device)
    if not fused:
        logits = model(**model_inputs(batch, device, model)).logits
        if metrics is not None:
            metrics.update(L.token_metric_stats(logits, labels, chunk_tokens=chunk_tokens, temperature=temperature))
        if temperature == 1.0 and not entropy:
            return L.token_nll(logits, labels), None, labels
        nll, ent = L.token_logprob_stats(logits, labels, temperature=temperature, entropy=entropy)
        return nll, ent, labels
    with fused_targets(model, labels, chunk_tokens, temperature=temperature, entropy=entropy,
                       metrics=metrics) as request:
        out = model(**model_inputs(batch, device, model))
    return request.result(out), (request.entropy_result(out) if entropy else None), labels
