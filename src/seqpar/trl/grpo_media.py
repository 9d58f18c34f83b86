"""Image prompts in the TRL GRPO drop-in's rollouts: each SP rank's share of the rows with their own images.

TRL hands `_generate_single_turn` the generation batch's rows with one multimodal field set for all of them
(pixel_values / image_grid_thw concatenated over the rows' images, per-token fields per row); `media_rows` cuts
out a contiguous share of rows with exactly their images (TRL's own split / unsplit by image grid), so every SP
rank samples its share (seqpar.hf.rollout_share.share_rollout) with the images its rows show.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from ..errors import SeqParError
from .args import refuse
from .collators import column_images

__all__ = ["media_rows", "has_pixels", "refuse_fetched_media", "row_images"]

_IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def media_rows(images: list | None, fields: dict[str, Any], rows: range, n: int) -> tuple[list | None, dict]:
    """(images, multimodal fields) of rows `rows` of a generation batch of `n` rows (TRL's `_tokenize_prompts`
    output); a share without images gets images None and no image fields, as TRL's own text rows."""
    imgs = None if images is None else [images[i] for i in rows]
    if imgs is not None and not any(imgs):
        imgs = None
    if not fields:
        return imgs, {}
    num = [len(x) if x else 0 for x in images] if images is not None else [0] * n
    fields = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()}  # as TRL's generate
    split = split_pixel_values_by_grid({**fields, "num_images": num}) if "pixel_values" in fields else dict(fields)
    out: dict[str, Any] = {}
    for k, v in split.items():
        if k == "num_images":
            continue
        if isinstance(v, (list, torch.Tensor)) and len(v) == n:  # one entry per row (TRL's split made them so)
            out[k] = [v[i] for i in rows] if isinstance(v, list) else v[rows.start:rows.stop]
        else:
            raise SeqParError(f"cannot share the rollout's multimodal field {k!r} ({type(v).__name__}) by rows: "
                              "image prompts of a Qwen-VL style model (pixel_values / image_grid_thw) are supported")
    out = unsplit_pixel_values_by_grid(out)
    if not has_pixels(out):
        for k in _IMAGE_KEYS:
            out.pop(k, None)
    return imgs, out


def row_images(inputs: list[dict[str, Any]]) -> list[list | None]:
    """Each row's images as TRL finds them (its `images` / `image` column, else the prompt's image content blocks);
    None for a row without."""
    out: list[list | None] = []
    for row in inputs:
        imgs = column_images(row)
        if imgs is None:
            prompt = row.get("prompt")
            imgs = [part["image"] for m in (prompt if isinstance(prompt, list) else [])
                    if isinstance(m.get("content"), list) for part in m["content"]
                    if isinstance(part, dict) and part.get("type") == "image" and part.get("image") is not None]
        out.append(list(imgs) if imgs else None)
    return out


def has_pixels(fields: dict[str, Any]) -> bool:
    """Whether these multimodal fields carry at least one image."""
    pv = fields.get("pixel_values")
    return isinstance(pv, torch.Tensor) and pv.numel() > 0


def refuse_fetched_media(trainer: Any, vlm: bool) -> None:
    """DeepSpeed ZeRO-3 with ds3_gather_for_generation=False fetches each module's weights at each call: the vision
    tower's fetches would then run only on ranks whose rows carry images, and ZeRO-3's prefetch follows each rank's
    own module trace. Refused at construction, before any rollout could hang; TRL's default (one gather of all
    weights per rollout, no per-module fetch) works."""
    ds = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if vlm and ds is not None and ds.zero_stage == 3 and not trainer.args.ds3_gather_for_generation:
        raise refuse(type(trainer).__name__, "DeepSpeed ZeRO-3 with ds3_gather_for_generation=False and a "
                     "vision-language model", "the vision tower's per-module fetches would run only on the ranks "
                     "whose rollout rows carry images", "leave ds3_gather_for_generation=True (TRL's default: "
                     "the weights gathered once per rollout on every rank), or use FSDP2")
