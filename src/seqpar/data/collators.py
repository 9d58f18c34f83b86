"""Collators (SFT, DPO): tokenized rows -> this rank's shard of an SP batch (see the `seqpar.data` docstring
for what they guarantee). Rows are validated one by one first (`prepare_row`), with messages naming the row.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SeqParError
from ..layout import padded_length, shard
from ..mesh import SequenceParallelMesh
from .sequence import cu_seqlens_from_position_ids, document_starts, shift_labels_full

__all__ = ["SequenceParallelCollator", "SequenceParallelDPOCollator", "PER_TOKEN_KEYS"]

PER_TOKEN_KEYS = ("input_ids", "position_ids", "shift_labels")


# ----------------------------------------------------------------------------- row validation
@dataclass
class _Row:
    input_ids: torch.Tensor  # [n] long
    labels: torch.Tensor  # [n] long, ignore_index where not supervised
    position_ids: torch.Tensor  # [n] long
    truncated: int = 0


def _as_1d_long(value: Any, what: str, i: int) -> torch.Tensor:
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise SeqParError(f"row {i}: {what} must be a list of ints or a 1-D tensor ({e})") from None
    if t.dim() == 2 and t.shape[0] == 1:  # a tokenizer's return_tensors="pt" output for one row
        t = t[0]
    if t.dim() != 1:
        raise SeqParError(f"row {i}: {what} must be 1-D (one row), got shape {tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.is_complex()):  # [] parses as float: allow it
        raise SeqParError(f"row {i}: {what} must hold integers, got {t.dtype}")
    return t.long()


def _prepare_row(
    row: Any, i: int, ignore_index: int, max_length: int | None, truncate: bool, packing: bool
) -> _Row:
    if not isinstance(row, Mapping):
        raise SeqParError(f"row {i} must be a dict with 'input_ids', got {type(row).__name__}")
    if "input_ids" not in row:
        raise SeqParError(f"row {i} has no 'input_ids' (keys: {sorted(row)}): tokenize it first")
    ids = _as_1d_long(row["input_ids"], "input_ids", i)
    if ids.numel() and int(ids.min()) < 0:
        raise SeqParError(
            f"row {i}: input_ids hold a negative id ({int(ids.min())}): mark unsupervised tokens in labels instead"
        )
    n = ids.numel()
    fields: dict[str, torch.Tensor] = {}
    for key in ("labels", "attention_mask", "position_ids"):
        if row.get(key) is not None:
            t = _as_1d_long(row[key], key, i)
            if t.numel() != n:
                raise SeqParError(
                    f"row {i}: '{key}' has {t.numel()} entries but 'input_ids' has {n}: they must match token for token"
                )
            fields[key] = t
    labels = fields.get("labels", ids.clone())
    # Token ids are non-negative, so every negative label means "not supervised".
    labels = torch.where(labels < 0, torch.full_like(labels, ignore_index), labels)
    pos = fields.get("position_ids", torch.arange(n))
    if "attention_mask" in fields:
        # Tokens masked out by the tokenizer are its padding: drop them, the collator pads itself.
        keep = fields["attention_mask"] != 0
        ids, labels = ids[keep], labels[keep]
        pos = pos[keep] if "position_ids" in fields else torch.arange(int(keep.sum()))
    if ids.numel() == 0:
        raise SeqParError(f"row {i} has no tokens (empty input_ids or all-zero attention_mask): drop it")
    if "position_ids" in fields:
        restarts = torch.nonzero(document_starts(pos)[1:]).reshape(-1)
        if not packing and restarts.numel():
            raise SeqParError(
                f"row {i}: position_ids restart at index {int(restarts[0]) + 1} (several documents in one row): "
                f"use packing=True so attention gets cu_seqlens"
            )
        if packing and int(pos[0]) != 0:
            raise SeqParError(f"row {i}: position_ids must start at 0 when packing, got {int(pos[0])}")
    truncated = 0
    if max_length is not None and ids.numel() > max_length:
        if not truncate:
            raise SeqParError(
                f"row {i} has {ids.numel()} tokens > max_length={max_length}: raise max_length, shorten the row, "
                f"or use truncate=True"
            )
        truncated = ids.numel() - max_length
        ids, labels, pos = ids[:max_length], labels[:max_length], pos[:max_length]
    return _Row(ids, labels, pos, truncated)


def _validate_batch(rows: Any) -> Sequence:
    if isinstance(rows, Mapping) or not isinstance(rows, Sequence):
        raise SeqParError(f"the collator takes a list of row dicts, got {type(rows).__name__}")
    if len(rows) == 0:
        raise SeqParError("empty batch: the collator needs at least one row (check the sampler / drop_last)")
    return rows


# ----------------------------------------------------------------------------- collators
class SequenceParallelCollator:
    """Collate tokenized rows into this rank's shard of an SP batch (SFT).

    rows: dicts with "input_ids" (list[int] or 1-D tensor) and optional "labels" (same length,
    negative = not supervised; default: every token supervised), "attention_mask" (0 = tokenizer
    padding, dropped) and "position_ids" (default arange; when packing, may restart at 0 to mark
    documents inside a row).

    Returns (per-token fields sharded along dim 1 with `seqpar.shard`):
      input_ids, position_ids, shift_labels: [B, S_loc] long (B = 1 when packing);
      cu_seqlens: [n_docs + 1] int32 FULL-sequence boundaries (packing only; padding is its own last doc);
      num_supervised_tokens, num_input_tokens, num_truncated_tokens: 0-dim long, for the FULL batch.
    There is deliberately no "labels" key: a model given unshifted labels would shift them per
    shard and lose a target at every shard boundary -- use shift_labels with `seqpar.loss.sft_loss`.
    """

    def __init__(
        self,
        mesh: SequenceParallelMesh,
        pad_token_id: int,
        label_pad: int = -100,
        packing: bool = False,
        max_length: int | None = None,
        *,
        truncate: bool = True,
    ) -> None:
        if not isinstance(mesh, SequenceParallelMesh):
            raise SeqParError(f"mesh must be a SequenceParallelMesh (seqpar.init_mesh), got {type(mesh).__name__}")
        try:
            pad_token_id = operator.index(pad_token_id)  # accepts numpy / tensor integers too
        except TypeError:
            pad_token_id = -1
        if pad_token_id < 0:
            raise SeqParError(
                "pad_token_id must be a non-negative int (use tokenizer.pad_token_id, or eos_token_id when the "
                "tokenizer has no pad token)"
            )
        if not isinstance(label_pad, int) or label_pad >= 0:
            raise SeqParError(f"label_pad must be a negative int (the loss ignore_index), got {label_pad!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise SeqParError(f"max_length must be a positive int or None, got {max_length!r}")
        self.mesh = mesh
        self.pad_token_id = pad_token_id
        self.label_pad = label_pad
        self.packing = bool(packing)
        self.max_length = max_length
        self.truncate = truncate

    # The FULL (unsharded) batch; exposed so references and tests can use the exact same layout.
    def collate_full(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = _validate_batch(rows)
        prepared = [
            _prepare_row(r, i, self.label_pad, self.max_length, self.truncate, self.packing)
            for i, r in enumerate(rows)
        ]
        return self._assemble(prepared)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return self.shard_batch(self.collate_full(rows))

    def shard_batch(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(full)
        for key in PER_TOKEN_KEYS:
            out[key] = shard(full[key], self.mesh, dim=1)
        return out

    def _assemble(self, rows: list[_Row]) -> dict[str, torch.Tensor]:
        ign = self.label_pad
        truncated = sum(r.truncated for r in rows)
        if self.packing:
            if self.max_length is not None:
                rows, cut = _cap_total(rows, self.max_length, self.truncate)
                truncated += cut
            ids = torch.cat([r.input_ids for r in rows])
            pos = torch.cat([r.position_ids for r in rows])
            # Shift per row: a row boundary is always a document boundary.
            tgt = torch.cat([shift_labels_full(r.labels, r.position_ids, ign) for r in rows])
            n = ids.numel()
            full_len = padded_length(n, self.mesh)
            pad = full_len - n
            ids = torch.cat([ids, torch.full((pad,), self.pad_token_id, dtype=torch.long)])
            pos = torch.cat([pos, torch.arange(pad)])  # padding = its own last document
            tgt = torch.cat([tgt, torch.full((pad,), ign, dtype=torch.long)])
            batch = {
                "input_ids": ids[None],
                "position_ids": pos[None],
                "shift_labels": tgt[None],
                "cu_seqlens": cu_seqlens_from_position_ids(pos),
            }
            num_input = n
        else:
            full_len = padded_length(max(r.input_ids.numel() for r in rows), self.mesh)
            ids_b, pos_b, tgt_b = [], [], []
            for r in rows:
                pad = full_len - r.input_ids.numel()
                ids_b.append(torch.cat([r.input_ids, torch.full((pad,), self.pad_token_id, dtype=torch.long)]))
                # Padding continues the positions (right padding, causal: no real token sees it).
                last = int(r.position_ids[-1])
                pos_b.append(torch.cat([r.position_ids, torch.arange(last + 1, last + 1 + pad)]))
                tgt = shift_labels_full(r.labels, r.position_ids, ign)
                tgt_b.append(torch.cat([tgt, torch.full((pad,), ign, dtype=torch.long)]))
            batch = {
                "input_ids": torch.stack(ids_b),
                "position_ids": torch.stack(pos_b),
                "shift_labels": torch.stack(tgt_b),
            }
            num_input = sum(r.input_ids.numel() for r in rows)
        batch["num_supervised_tokens"] = (batch["shift_labels"] != ign).sum()
        batch["num_input_tokens"] = torch.tensor(num_input, dtype=torch.long)
        batch["num_truncated_tokens"] = torch.tensor(truncated, dtype=torch.long)
        return batch


def _cap_total(rows: list[_Row], max_length: int, truncate: bool) -> tuple[list[_Row], int]:
    """Keep at most max_length packed tokens (rows in order, the last one cut on the right)."""
    total = sum(r.input_ids.numel() for r in rows)
    if total <= max_length:
        return rows, 0
    if not truncate:
        raise SeqParError(
            f"packed batch has {total} tokens > max_length={max_length}: use fewer rows per batch, raise "
            f"max_length, or use truncate=True"
        )
    kept, room = [], max_length
    for r in rows:
        if room <= 0:
            break
        k = min(room, r.input_ids.numel())
        kept.append(_Row(r.input_ids[:k], r.labels[:k], r.position_ids[:k]))
        room -= k
    return kept, total - max_length


class SequenceParallelDPOCollator(SequenceParallelCollator):
    """Collate preference pairs for DPO/IPO/SimPO under SP (no packing).

    rows: {"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"} (lists of ints or 1-D
    tensors; the completions must not repeat the prompt). Returns the SFT collator's keys for a
    batch of 2B rows -- [chosen_0..chosen_{B-1}, rejected_0..rejected_{B-1}], each prompt +
    completion, right-padded to one length -- with prompt tokens unsupervised (the last prompt
    token's target is the first completion token), plus "num_pairs" (0-dim long, = B).
    With max_length, each prompt + completion is cut on the right (counted in num_truncated_tokens).

    Precomputed reference log-probs (TRL style): when EVERY row also has "ref_chosen_logps" and
    "ref_rejected_logps" (floats: sums of the reference model's log-probs over the full completion
    tokens), the batch gets "ref_logps": float32 [2B] in the row order [chosen..., rejected...], the
    same on every SP rank (per sequence, never sharded). They describe the untruncated completion, so
    a batch that max_length would cut raises SeqParError, as does a batch where only some rows have them.
    """

    def __init__(
        self,
        mesh: SequenceParallelMesh,
        pad_token_id: int,
        label_pad: int = -100,
        max_length: int | None = None,
        *,
        truncate: bool = True,
    ) -> None:
        super().__init__(mesh, pad_token_id, label_pad, packing=False, max_length=max_length, truncate=truncate)

    def collate_full(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = _validate_batch(rows)
        chosen, rejected = [], []
        for i, r in enumerate(rows):
            if not isinstance(r, Mapping):
                raise SeqParError(f"pair {i} must be a dict, got {type(r).__name__}")
            missing = [k for k in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids") if k not in r]
            if missing:
                raise SeqParError(f"pair {i} lacks {missing}: DPO rows need prompt/chosen/rejected input_ids")
            prompt = _as_1d_long(r["prompt_input_ids"], "prompt_input_ids", i)
            for side, out in (("chosen", chosen), ("rejected", rejected)):
                comp = _as_1d_long(r[f"{side}_input_ids"], f"{side}_input_ids", i)
                if comp.numel() == 0:
                    raise SeqParError(f"pair {i}: {side}_input_ids is empty: drop the pair")
                ids = torch.cat([prompt, comp])
                labels = torch.cat([torch.full_like(prompt, self.label_pad), comp])
                out.append({"input_ids": ids, "labels": labels})
        prepared = [
            _prepare_row(r, i, self.label_pad, self.max_length, self.truncate, False)
            for i, r in enumerate(chosen + rejected)
        ]
        batch = self._assemble(prepared)
        batch["num_pairs"] = torch.tensor(len(rows), dtype=torch.long)
        ref = _precomputed_ref_logps(rows)
        if ref is not None:
            if int(batch["num_truncated_tokens"]) > 0:
                raise SeqParError(
                    f"max_length={self.max_length} cuts {int(batch['num_truncated_tokens'])} tokens, but the rows' "
                    f"ref_chosen_logps/ref_rejected_logps are sums over the full completions: drop or shorten "
                    f"those pairs, raise max_length, or recompute the reference log-probs on the truncated rows"
                )
            batch["ref_logps"] = ref
        return batch


_REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def _precomputed_ref_logps(rows: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """float32 [2B] = [ref_chosen..., ref_rejected...] when every row has both keys, None when none has."""
    has = [all(k in r for k in _REF_KEYS) for r in rows]
    partial = [i for i, r in enumerate(rows) if any(k in r for k in _REF_KEYS) and not has[i]]
    if not any(has) and not partial:
        return None
    if partial or not all(has):
        missing = [i for i, h in enumerate(has) if not h]
        raise SeqParError(
            f"pairs {missing} lack ref_chosen_logps/ref_rejected_logps while others have them: precompute "
            f"both for every row of the dataset, or remove both columns to use a reference model"
        )
    vals: list[list[float]] = [[], []]
    for i, r in enumerate(rows):
        for j, k in enumerate(_REF_KEYS):
            v = r[k]
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    raise SeqParError(f"pair {i}: {k} must be one float per sequence, got shape {tuple(v.shape)}")
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise SeqParError(f"pair {i}: {k} must be a finite float (a log-prob sum), got {v!r}")
            vals[j].append(float(v))
    # float64 -> float32 once: the policy log-probs are float32 sums too.
    return torch.tensor(vals[0] + vals[1], dtype=torch.float64).to(torch.float32)
