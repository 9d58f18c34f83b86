"""TRL's prepared rows -> seqpar SP batches (the seqpar collators do the work; this only renames).

SFT rows from `trl.SFTTrainer._prepare_dataset`: "input_ids", "labels" (-100 = not trained: TRL built
them from completion_mask / assistant_masks) and, for packed rows, "seq_lengths" (document lengths),
which become per-document position_ids so seqpar's packing path gets cu_seqlens and never attends or
predicts across a document boundary. DPO rows from `trl.DPOTrainer._prepare_dataset`: "prompt_ids",
"chosen_ids", "rejected_ids" (+ optional "ref_chosen_logps"/"ref_rejected_logps"). DPO rows with images (TRL does not
prepare those): TRL's own DataCollatorForVisionPreference renders and tokenizes each micro-batch with the processor
(the images' placeholders expanded, their pixel values made), and `TRLVisionDPOCollator` takes the pairs and their
prompt images back out of its padded output for seqpar.data.VisionDPOCollator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..data import SequenceParallelCollator, SequenceParallelDPOCollator, VisionDPOCollator
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh

_IGNORE = -100

__all__ = ["TRLSFTCollator", "TRLDPOCollator", "TRLVisionDPOCollator", "grpo_rows", "column_images"]


def _sft_row(row: Mapping[str, Any], i: int) -> dict[str, Any]:
    if not isinstance(row, Mapping) or "input_ids" not in row:
        raise SeqParError(f"row {i} has no 'input_ids': let TRL prepare the dataset (no skip_prepare_dataset "
                          "without tokenised rows)")
    out: dict[str, Any] = {"input_ids": row["input_ids"]}
    if row.get("labels") is not None:
        out["labels"] = row["labels"]
    if row.get("seq_lengths") is not None:
        out["position_ids"] = torch.cat([torch.arange(int(n)) for n in row["seq_lengths"]])
    return out


class TRLSFTCollator(SequenceParallelCollator):
    """SequenceParallelCollator over TRL SFT rows (packed rows: seq_lengths -> position_ids resets)."""

    def collate_full(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return super().collate_full([_sft_row(r, i) for i, r in enumerate(rows)])


_DPO_KEYS = {"prompt_ids": "prompt_input_ids", "chosen_ids": "chosen_input_ids", "rejected_ids": "rejected_input_ids"}


def _dpo_row(row: Mapping[str, Any], i: int) -> dict[str, Any]:
    missing = [k for k in _DPO_KEYS if not isinstance(row, Mapping) or k not in row]
    if missing:
        raise SeqParError(f"pair {i} lacks {missing}: let trl.DPOTrainer prepare the dataset (prompt/chosen/rejected)")
    out = {new: row[old] for old, new in _DPO_KEYS.items()}
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        if row.get(key) is not None:
            out[key] = row[key]
    return out


class TRLDPOCollator(SequenceParallelDPOCollator):
    """SequenceParallelDPOCollator over TRL DPO rows ([chosen..., rejected...], prompt unsupervised)."""

    def collate_full(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return super().collate_full([_dpo_row(r, i) for i, r in enumerate(rows)])


def column_images(row: Mapping[str, Any]) -> list | None:
    """A row's images from TRL's image columns ("images": a list, "image": one or None); None without either."""
    if "images" in row:
        return list(row["images"] or [])
    if "image" in row:
        return [] if row["image"] is None else [row["image"]]
    return None


def vision_pairs(trl_collator: Any, rows: Sequence[Mapping[str, Any]], max_length: int | None) -> list[dict]:
    """TRL vision DPO rows -> pairs (prompt / chosen / rejected ids + the prompt's images) through TRL's collator:
    its output holds [chosen..., rejected...] rows (prompt + response, flushed left, cut at max_length) and every
    row's images, the rejected rows' repeating the chosen rows'."""
    counts = [len(column_images(r) or []) for r in rows]
    out = trl_collator([dict(r) for r in rows])  # TRL's collator rewrites the rows' keys
    ids, keep, comp = out["input_ids"], out["attention_mask"].bool(), out["completion_mask"].bool()
    b = len(rows)
    media = {"num_images": counts}
    if out.get("image_grid_thw") is not None:  # the chosen rows' images come first
        grid = out["image_grid_thw"][:sum(counts)]
        media.update(image_grid_thw=grid, pixel_values=out["pixel_values"][:int(grid.prod(-1).sum())])
    pairs = []
    for i, m in enumerate(_row_media(media, b)):
        sides = [(ids[j][keep[j]], comp[j][keep[j]]) for j in (i, i + b)]
        prompt = sides[0][0][~sides[0][1]]
        if not bool(sides[0][1].any() and sides[1][1].any()):
            raise SeqParError(f"pair {i}: its prompt (images expanded) has {prompt.numel()} tokens, which leaves "
                              f"no chosen or rejected token within max_length={max_length}: raise max_length")
        pairs.append({"prompt_input_ids": prompt, "chosen_input_ids": sides[0][0][sides[0][1]],
                      "rejected_input_ids": sides[1][0][sides[1][1]], **m})
    return pairs


class TRLVisionDPOCollator(VisionDPOCollator):
    """seqpar.data.VisionDPOCollator over TRL's raw vision DPO rows ("prompt", "chosen", "rejected", "images" or
    "image"): TRL's DataCollatorForVisionPreference renders them as stock TRL does (vision_pairs)."""

    def __init__(self, mesh: SequenceParallelMesh, pad_token_id: int, trl_collator: Any,
                 max_length: int | None = None) -> None:
        super().__init__(mesh, pad_token_id, max_length=max_length)
        self.trl_collator = trl_collator

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return super().__call__(vision_pairs(self.trl_collator, rows, self.max_length))


def _row_media(inputs: dict[str, Any], n_rows: int) -> list[dict[str, Any]]:
    """Per row, its images from TRL's generation batch (Qwen VL: pixel_values [patches, D], image_grid_thw
    [images, 3], num_images per row), as seqpar.data.VisionCollator keys; {} for text-only rows."""
    grid, pixels, counts = inputs.get("image_grid_thw"), inputs.get("pixel_values"), inputs.get("num_images")
    if grid is None or pixels is None:
        return [{} for _ in range(n_rows)]
    counts = list(counts) if counts is not None else [1] * n_rows
    if len(counts) != n_rows or sum(counts) != grid.shape[0]:
        raise SeqParError(f"TRL's batch has {grid.shape[0]} images for num_images={counts} over {n_rows} rows")
    out, img, patch = [], 0, 0
    for k in counts:
        g = grid[img:img + k]
        n = int(g.prod(-1).sum())
        out.append({"pixel_values": pixels[patch:patch + n], "image_grid_thw": g} if k else {})
        img, patch = img + k, patch + n
    return out


def grpo_rows(inputs: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """TRL's padded prompt / completion tensors -> unpadded rows, only completion tokens supervised, each with its
    prompt's images (vision-language models)."""
    rows = []
    for p, pm, c, cm in zip(inputs["prompt_ids"].tolist(), inputs["prompt_mask"].tolist(),
                            inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist()):
        prompt = [t for t, m in zip(p, pm) if m]
        comp = [t for t, m in zip(c, cm) if m]
        rows.append({"input_ids": prompt + comp, "labels": [_IGNORE] * len(prompt) + comp})
    return [{**r, **m} for r, m in zip(rows, _row_media(inputs, len(rows)))]
