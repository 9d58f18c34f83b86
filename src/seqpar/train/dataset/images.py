"""Chat data with images for `seqpar train` on a vision-language model (Qwen2.5-VL, Qwen3-VL).

A row is a conversation (`messages`, ShareGPT `conversations`, ...: what seqpar.train.dataset.formats reads) plus
`images`: local image files (paths relative to the dataset file), one per `<image>` placeholder in the
message contents, in order:

    {"messages": [{"role": "user", "content": "<image>What is drawn here?"},
                  {"role": "assistant", "content": "A red square."}],
     "images": ["imgs/square.png"]}

Each placeholder becomes vision start + N image tokens + vision end (N = the image's merged patches from
the model's image processor); none of them is supervised. The examples carry the images' patches
(`pixel_values`, `image_grid_thw`); `VisionCollator` hands the FULL batch to the step, which calls
`seqpar.hf.sp_vlm_inputs` (multimodal RoPE on the full sequence, each image encoded once per SP group).
SFT only; packing, truncation inside an image and videos are refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...data import SequenceParallelCollator
from ...errors import SeqParError
from ..model.tokenizers import ByteTokenizer
from .formats import check_stage, detect_format
from .tokenize import IGNORE, tokenize_sft

__all__ = ["VisionSpec", "PLACEHOLDER", "build_vision_examples", "VisionCollator"]

PLACEHOLDER = "<image>"
# Qwen VL tokenizers know these as single special tokens; a byte tokenizer renders the placeholder as bytes.
_QWEN_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class VisionSpec:
    """What the data path needs from the model: its special ids and an image processor."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    merge: int  # spatial merge size: a grid of t x h x w patches becomes t*h*w / merge**2 tokens
    processor: Any

    @classmethod
    def from_model_config(cls, config: Any, name: str | None = None) -> VisionSpec:
        """The processor from `name` (a model directory) when it has one, else built from the vision config
        (tiny models): the PIL image processor of Qwen2-VL, which needs no torchvision."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        vc = config.vision_config
        proc = None
        if name is not None and os.path.isdir(name) and os.path.exists(os.path.join(name, "preprocessor_config.json")):
            proc = Qwen2VLImageProcessorPil.from_pretrained(name)
        if proc is None:
            unit = vc.patch_size * vc.spatial_merge_size
            proc = Qwen2VLImageProcessorPil(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                            temporal_patch_size=vc.temporal_patch_size,
                                            min_pixels=unit * unit, max_pixels=(8 * unit) ** 2)
        return cls(int(config.image_token_id), int(config.vision_start_token_id), int(config.vision_end_token_id),
                   int(vc.spatial_merge_size), proc)

    def encode_images(self, paths: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        images = []
        for p in paths:
            try:
                with Image.open(p) as im:
                    images.append(im.convert("RGB"))
            except (OSError, ValueError) as e:
                raise SeqParError(f"cannot read image {p!r}: {e}") from None
        out = self.processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def _marker_ids(tok: Any) -> tuple[str, list[int]]:
    """The text a placeholder is rendered as, and the ids it tokenizes to (context-free: bytes, or the
    Qwen special tokens)."""
    if isinstance(tok, ByteTokenizer):
        return PLACEHOLDER, tok.encode(PLACEHOLDER)
    ids = tok.encode(_QWEN_MARKER)
    if len(ids) != 3:
        raise SeqParError("the tokenizer does not know Qwen's <|vision_start|><|image_pad|><|vision_end|> special "
                          "tokens: use the vision-language model's own tokenizer (model.tokenizer)")
    return _QWEN_MARKER, ids


def _with_marker(row: Mapping[str, Any], marker: str) -> dict[str, Any]:
    def swap(v: Any) -> Any:
        if isinstance(v, str):
            return v.replace(PLACEHOLDER, marker)
        if isinstance(v, list):
            return [swap(x) for x in v]
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        return v

    return {k: (swap(v) if k != "images" else v) for k, v in row.items()}


def _find_all(ids: list[int], pattern: list[int]) -> list[int]:
    out, i, n = [], 0, len(pattern)
    while i + n <= len(ids):
        if ids[i:i + n] == pattern:
            out.append(i)
            i += n
        else:
            i += 1
    return out


def _expand(ids: list[int], labels: list[int], starts: list[int], width: int, counts: list[int],
            spec: VisionSpec) -> tuple[list[int], list[int]]:
    new_ids: list[int] = []
    new_labels: list[int] = []
    prev = 0
    for at, n in zip(starts, counts):
        new_ids += ids[prev:at] + [spec.vision_start_id] + [spec.image_token_id] * n + [spec.vision_end_id]
        new_labels += labels[prev:at] + [IGNORE] * (n + 2)
        prev = at + width
    return new_ids + ids[prev:], new_labels + labels[prev:]


def _vision_row(row: Mapping[str, Any], i: int, fmt: str, tok: Any, spec: VisionSpec, base_dir: str,
                train_on_prompt: bool, mask_history: bool) -> dict[str, Any]:
    paths = row.get("images") or []
    if isinstance(paths, str):
        paths = [paths]
    marker, pattern = _marker_ids(tok)
    out = tokenize_sft(_with_marker(row, marker), fmt, tok, train_on_prompt=train_on_prompt,
                       mask_history=mask_history, index=i)
    starts = _find_all(out["input_ids"], pattern)
    if len(starts) != len(paths):
        raise SeqParError(f"row {i}: {len(starts)} {PLACEHOLDER} placeholders but {len(paths)} images: put one "
                          f"{PLACEHOLDER} in the messages where each image goes")
    if not paths:
        return out
    pixels, grid = spec.encode_images([p if os.path.isabs(p) else os.path.join(base_dir, p) for p in paths])
    counts = (grid.prod(-1) // spec.merge**2).tolist()
    ids, labels = _expand(out["input_ids"], out["labels"], starts, len(pattern), counts, spec)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels, "image_grid_thw": grid}


def build_vision_examples(rows: list[dict[str, Any]], fmt: str, tok: Any, spec: VisionSpec, max_length: int,
                          base_dir: str, *, train_on_prompt: bool = False,
                          mask_history: bool = False) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Tokenized rows with their images (see the module docstring) + the stats build_examples reports."""
    if fmt == "auto":
        fmt = detect_format([c for c in rows[0] if c != "images"])
    check_stage(fmt, "sft")
    stats = {"rows": len(rows), "truncated": 0, "dropped_unsupervised": 0, "prompt_truncated": 0,
             "dropped_long_prompt": 0}
    examples = []
    for i, row in enumerate(rows, 1):  # 1-based: the line of a JSONL file
        ex = _vision_row(row, i, fmt, tok, spec, base_dir, train_on_prompt, mask_history)
        if len(ex["input_ids"]) > max_length:
            last_image = max((j for j, t in enumerate(ex["input_ids"]) if t == spec.vision_end_id), default=-1)
            if last_image >= max_length:
                raise SeqParError(f"row {i}: its images end at token {last_image + 1}, beyond dataset.max_length="
                                  f"{max_length}: raise max_length (an image cannot be cut)")
            ex = {**ex, "input_ids": ex["input_ids"][:max_length], "labels": ex["labels"][:max_length]}
            stats["truncated"] += 1
        if not any(lab != IGNORE for lab in ex["labels"][1:]):
            stats["dropped_unsupervised"] += 1
            continue
        examples.append(ex)
    if not examples:
        raise SeqParError(f"no row keeps a supervised token within dataset.max_length={max_length}")
    return examples, stats


class VisionCollator(SequenceParallelCollator):
    """The text collator's shards, plus the FULL input ids and the batch's images for sp_vlm_inputs."""

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        full = self.collate_full(rows)
        out = self.shard_batch(full)
        out["full_input_ids"] = full["input_ids"]
        pixels = [r["pixel_values"] for r in rows if r.get("pixel_values") is not None]
        if pixels:
            out["pixel_values"] = torch.cat(pixels)
            out["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in rows if r.get("pixel_values") is not None])
        return out
