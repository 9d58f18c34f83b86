"""The collator of vision-language rows (Qwen2.5-VL, Qwen3-VL): the text collator's shards, plus the FULL input
ids and the batch's images / videos, which only the model can shard (seqpar.hf.vision.sp_vlm_inputs computes
the multimodal RoPE ids on the full sequence and encodes each medium once per SP group).

A row: "input_ids" with the processor's expanded placeholders, "labels", and optionally "pixel_values" /
"image_grid_thw" (images), "pixel_values_videos" / "video_grid_thw" (videos) and "second_per_grid_ts"
(Qwen2.5-VL: seconds per temporal patch, one per video): tensors or nested lists (a `datasets.Dataset` stores
lists). Packed rows (packing=True) keep their media in row order; cu_seqlens mark the documents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import SeqParError
from .collators import SequenceParallelCollator

__all__ = ["VisionCollator", "MEDIA_KEYS"]

MEDIA_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def _media(rows: Sequence[Mapping[str, Any]], pixels: str, grid: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    have = [(i, r) for i, r in enumerate(rows) if r.get(grid) is not None and len(r[grid])]
    if not have:
        return None
    pv, gr = [], []
    for i, r in have:
        if r.get(pixels) is None:
            raise SeqParError(f"row {i} has {grid} but no {pixels}")
        p = r[pixels] if isinstance(r[pixels], torch.Tensor) else torch.as_tensor(r[pixels], dtype=torch.float32)
        g = torch.as_tensor(r[grid], dtype=torch.long).reshape(-1, 3)
        if int(g.prod(-1).sum()) != int(p.shape[0]):
            raise SeqParError(f"row {i}: {pixels} has {p.shape[0]} patches but {grid} describes "
                              f"{int(g.prod(-1).sum())}")
        pv.append(p)
        gr.append(g)
    return torch.cat(pv), torch.cat(gr)


def _seconds(rows: Sequence[Mapping[str, Any]]) -> torch.Tensor | None:
    """second_per_grid_ts of the batch's videos in order; None when no row gives them."""
    videos = [r for r in rows if r.get("video_grid_thw") is not None and len(r["video_grid_thw"])]
    given = [r.get("second_per_grid_ts") is not None for r in videos]
    if not any(given):
        return None
    if not all(given):
        raise SeqParError("some rows with videos have second_per_grid_ts and others not: give it for every video "
                          "(seconds per temporal patch = temporal_patch_size / fps)")
    return torch.cat([torch.as_tensor(r["second_per_grid_ts"], dtype=torch.float32).reshape(-1) for r in videos])


class VisionCollator(SequenceParallelCollator):
    """The text collator's shards, plus "full_input_ids" and the batch's media for sp_vlm_inputs (the step code
    hands such a batch to the model's seqpar.unwrap.BATCH_INPUTS_HOOK)."""

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        full = self.collate_full(rows)
        out = self.shard_batch(full)
        out["full_input_ids"] = full["input_ids"]
        for pixels, grid in MEDIA_KEYS:
            got = _media(rows, pixels, grid)
            if got is not None:
                out[pixels], out[grid] = got
        ts = _seconds(rows)
        if ts is not None:
            out["second_per_grid_ts"] = ts
        return out
