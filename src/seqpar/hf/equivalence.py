"""A small SP-vs-no-SP equivalence check for one model and one SFT batch (tests, `seqpar verify`).

Call it on every rank of the mesh. The reference runs the unmodified model on every row (every
packed document) separately, unpadded, in this process; the SP side runs the collator, the
SP-applied model and seqpar.loss, with gradients summed over dp x sp (the loss convention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import loss as L
from ..data import SequenceParallelCollator
from ..errors import SeqParError
from ..layout import unshard
from ..mesh import SequenceParallelMesh
from .attention import apply_sequence_parallel

__all__ = ["compare", "sp_sft_step"]


def _doc_terms(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any, int]:
    logits = model(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None]).logits[0]
    nll = F.cross_entropy(logits[:-1].double(), labels[1:], ignore_index=-100, reduction="sum")
    return logits.detach(), nll, int((labels[1:] != -100).sum())


def _reference(ref: torch.nn.Module, rows_per_dp: Sequence[Sequence[dict]],
               dp_rank: int) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
    """The global token-mean NLL of every dp rank's rows on the unmodified model (one forward per row), the
    supervised-token count, and this dp rank's per-row logits."""
    total, count, ref_logits = 0.0, 0, []
    for d, rows in enumerate(rows_per_dp):
        for r in rows:
            ids = torch.as_tensor(r["input_ids"]).long().reshape(-1)
            labels = torch.as_tensor(r.get("labels", ids)).long().reshape(-1)
            lo, nll, c = _doc_terms(ref, ids, labels)
            total, count = total + nll, count + c
            if d == dp_rank:
                ref_logits.append(lo)
    return total / max(count, 1), count, ref_logits


def _grad_err(ref: torch.nn.Module, sp: torch.nn.Module) -> float:
    """Max abs gradient difference, parameter by parameter (a missing gradient counts as zeros)."""
    err = 0.0
    for (_, p), (_, q) in zip(ref.named_parameters(), sp.named_parameters()):
        if p.grad is None and q.grad is None:
            continue
        a = p.grad if p.grad is not None else torch.zeros_like(p)
        b = q.grad if q.grad is not None else torch.zeros_like(q)
        err = max(err, float((a.double() - b.double()).abs().max()))
    return err


def sp_sft_step(sp: torch.nn.Module, batch: dict, mesh: SequenceParallelMesh) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """One SFT forward + backward of an SP model on a collator batch, gradients summed over dp x sp: (this rank's
    loss share, the full logits [B, S, V] unsharded, the global supervised-token count)."""
    kw = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if "cu_seqlens" in batch:
        kw["cu_seqlens"] = batch["cu_seqlens"]
    logits = sp(**kw).logits
    num = L.global_token_count(batch["num_supervised_tokens"], mesh)
    share = L.sft_loss(logits, batch["shift_labels"], num)
    share.backward()
    L.sum_gradients(sp.parameters(), mesh)
    return share, unshard(logits.detach(), mesh, 1), num


def compare(
    model_fn: Callable[[], torch.nn.Module],
    rows_per_dp: Sequence[Sequence[dict]],
    mesh: SequenceParallelMesh,
    *,
    packing: bool = False,
    pad_token_id: int = 0,
) -> dict[str, float]:
    """Max abs errors of SP vs no SP: {"loss", "grad", "logits", "count", "loss_value"}.

    model_fn() must return identical models on every call and rank (fixed seed / same weights).
    rows_per_dp[d]: the SFT rows ({"input_ids", optional "labels"}) of dp rank d (one list per dp
    rank, all given to every rank: the reference needs the global batch). packing=True packs each
    dp rank's rows into one row (documents), else they are padded rows of a batch.
    """
    if len(rows_per_dp) != mesh.dp_size:
        raise SeqParError(f"rows_per_dp has {len(rows_per_dp)} lists, the mesh has dp_size={mesh.dp_size}")
    ref = model_fn()
    sp = apply_sequence_parallel(model_fn(), mesh)
    ref.train()
    sp.train()
    want, count, ref_logits = _reference(ref, rows_per_dp, mesh.dp_rank)
    want.backward()
    batch = SequenceParallelCollator(mesh, pad_token_id=pad_token_id, packing=packing)(rows_per_dp[mesh.dp_rank])
    share, full, num = sp_sft_step(sp, batch, mesh)
    logit_err, off = 0.0, 0
    for i, lo in enumerate(ref_logits):
        got = full[0, off : off + lo.shape[0]] if packing else full[i, : lo.shape[0]]
        logit_err = max(logit_err, float((got - lo).abs().max()))
        off += lo.shape[0]
    return {
        "loss": abs(float(L.global_loss(share, mesh)) - float(want.detach())),
        "grad": _grad_err(ref, sp),
        "logits": logit_err,
        "count": float(abs(int(num) - count)),
        "loss_value": float(want.detach()),
    }
