"""The collator of vision-language rows (Qwen2.5-VL, Qwen3-VL): the text collator's shards, plus the FULL input
ids and the batch's images / videos, which only the model can shard (seqpar.hf.vision.sp_vlm_inputs computes
the multimodal RoPE ids on the full sequence and encodes each medium once per SP group).

A row: "input_ids" with the processor's expanded placeholders, "labels", and optionally "pixel_values" /
"image_grid_thw" (images), "pixel_values_videos" / "video_grid_thw" (videos) and "second_per_grid_ts"
(Qwen2.5-VL: seconds per temporal patch, one per video): tensors or nested lists (a `datasets.Dataset` stores
lists). Packed rows (packing=True) keep their media in row order; cu_seqlens mark the documents. DPO pairs
(VisionDPOCollator): the prompt's media on the pair, given to both its chosen and its rejected row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import SeqParError
from .collators import SequenceParallelCollator, SequenceParallelDPOCollator

__all__ = ["VisionCollator", "VisionDPOCollator", "MEDIA_KEYS"]

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


def _add_media(out: dict[str, torch.Tensor], rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """The rows' media into the batch `out`, in row order; the number of images and of videos."""
    counts = []
    for pixels, grid in MEDIA_KEYS:
        got = _media(rows, pixels, grid)
        if got is not None:
            out[pixels], out[grid] = got
        counts.append(0 if got is None else int(got[1].shape[0]))
    ts = _seconds(rows)
    if ts is not None:
        out["second_per_grid_ts"] = ts
    return counts


class VisionCollator(SequenceParallelCollator):
    """The text collator's shards, plus "full_input_ids" and the batch's media for sp_vlm_inputs (the step code
    hands such a batch to the model's seqpar.unwrap.BATCH_INPUTS_HOOK)."""

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        full = self.collate_full(rows)
        out = self.shard_batch(full)
        out["full_input_ids"] = full["input_ids"]
        _add_media(out, rows)
        return out


class VisionDPOCollator(SequenceParallelDPOCollator):
    """DPO pairs whose prompts carry images / videos (the VisionCollator keys on the pair, e.g. "pixel_values" and
    "image_grid_thw"): the DPO collator's [chosen..., rejected...] rows, "full_input_ids", and every row's prompt
    media in that row order (each pair's media twice). "media_same_as" (per medium, images then videos: the
    index whose embedding it takes) points each rejected row's media at its chosen row's, so sp_vlm_inputs
    encodes every prompt medium once and sums its gradient over both sequences."""

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        full = self.collate_full(rows)
        out = self.shard_batch(full)
        out["full_input_ids"] = full["input_ids"]
        counts = _add_media(out, list(rows) + list(rows))
        same, base = [], 0
        for n in counts:  # images [chosen rows' n/2, rejected rows' n/2], then videos alike
            half = list(range(base, base + n // 2))
            same += half + half
            base += n
        if same:
            out["media_same_as"] = torch.tensor(same, dtype=torch.long)
        return out
