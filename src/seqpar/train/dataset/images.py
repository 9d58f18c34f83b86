"""Chat data with images and videos for `seqpar train` on a vision-language model (Qwen2.5-VL, Qwen3-VL).

A row is a conversation (`messages`, ShareGPT `conversations`, ...: what seqpar.train.dataset.formats reads) plus
`images` (local image files) and / or `videos` (frame folders, GIFs: train/dataset/videos.py), paths relative to
the dataset file, one per `<image>` / `<video>` placeholder in the message contents, in order:

    {"messages": [{"role": "user", "content": "<image>What is drawn here? <video>And here?"},
                  {"role": "assistant", "content": "A red square, then a ball rolling."}],
     "images": ["imgs/square.png"], "videos": [{"path": "clips/ball", "fps": 2}]}

Each image placeholder becomes vision start + N image tokens + vision end (N = the image's merged patches from
the model's image processor); a video the same with video tokens (Qwen3-VL: one such run per temporal patch,
after its `<t seconds>` timestamp); none of them is supervised. The examples carry the media's patches;
seqpar.data.VisionCollator hands the FULL batch to the step, which calls `seqpar.hf.sp_vlm_inputs`
(multimodal RoPE on the full sequence, per document of a packed row; each medium encoded once per SP group).
Truncation inside a medium is refused. `expand_media` does the same for GRPO prompts.

DPO rows ({"prompt", "chosen", "rejected"} + `images` / `videos`): the placeholders go in the prompt, whose
media both responses see; prompts with media are never cut (max_prompt_length refuses them), and pairs whose
prompt reaches max_length are dropped as for text pairs. seqpar.data.VisionDPOCollator gives each chosen and
rejected row its prompt's media.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...data import VisionCollator
from ...errors import SeqParError
from ..model.tokenizers import ByteTokenizer
from .formats import check_stage, detect_format
from .tokenize import IGNORE, build_dpo_pairs, new_stats, pack_rows, tokenize_dpo, tokenize_sft
from .videos import frame_timestamps, read_frames, video_patches

__all__ = ["VisionSpec", "PLACEHOLDER", "VIDEO_PLACEHOLDER", "build_vision_examples", "build_vision_dpo_examples",
           "expand_media", "media_columns", "VisionCollator", "carries_media", "refuse_media_rows", "TEXT_ONLY"]

PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
# Qwen VL tokenizers know these as single special tokens; a byte tokenizer renders the placeholder as bytes.
_QWEN_MARKERS = {PLACEHOLDER: "<|vision_start|><|image_pad|><|vision_end|>",
                 VIDEO_PLACEHOLDER: "<|vision_start|><|video_pad|><|vision_end|>"}


@dataclass
class VisionSpec:
    """What the data path needs from the model: its special ids, an image processor and the video timing."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    merge: int  # spatial merge size: a grid of t x h x w patches becomes t*h*w / merge**2 tokens
    processor: Any
    video_token_id: int = -1
    temporal: int = 2  # frames per patch in time
    timestamps: bool = False  # Qwen3-VL: a `<t seconds>` text before each temporal patch of a video

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
                   int(vc.spatial_merge_size), proc, int(config.video_token_id), int(vc.temporal_patch_size),
                   config.model_type == "qwen3_vl")

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

    def encode_videos(self, entries: Sequence[Any], base_dir: str) -> tuple[torch.Tensor, torch.Tensor, list, list]:
        """(patches, grids [n, 3], seconds per temporal patch, per-patch timestamps) of the videos."""
        pv, grids, seconds, stamps = [], [], [], []
        for e in entries:
            frames, fps = read_frames(e, base_dir)
            x, grid = video_patches(self.processor, frames, self.temporal)
            pv.append(x)
            grids.append(grid)
            seconds.append(self.temporal / fps)
            stamps.append(frame_timestamps(len(frames), fps, self.temporal))
        return torch.cat(pv), torch.tensor(grids), seconds, stamps


def _marker_ids(tok: Any, placeholder: str) -> tuple[str, list[int]]:
    """The text a placeholder is rendered as, and the ids it tokenizes to (context-free: bytes, or the
    Qwen special tokens)."""
    if isinstance(tok, ByteTokenizer):
        return placeholder, tok.encode(placeholder)
    marker = _QWEN_MARKERS[placeholder]
    ids = tok.encode(marker)
    if len(ids) != 3:
        raise SeqParError(f"the tokenizer does not know Qwen's {marker} special tokens: use the vision-language "
                          "model's own tokenizer (model.tokenizer)")
    return marker, ids


def with_markers(row: Mapping[str, Any], tok: Any) -> dict[str, Any]:
    """The row with its placeholders rendered as the tokenizer's markers (media columns untouched)."""
    marks = {p: _marker_ids(tok, p)[0] for p in (PLACEHOLDER, VIDEO_PLACEHOLDER)}

    def swap(v: Any) -> Any:
        if isinstance(v, str):
            for p, m in marks.items():
                v = v.replace(p, m)
            return v
        if isinstance(v, list):
            return [swap(x) for x in v]
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        return v

    return {k: (swap(v) if k not in ("images", "videos") else v) for k, v in row.items()}


def _find_all(ids: list[int], pattern: list[int]) -> list[int]:
    out, i, n = [], 0, len(pattern)
    while i + n <= len(ids):
        if ids[i:i + n] == pattern:
            out.append(i)
            i += n
        else:
            i += 1
    return out


def media_columns(row: Mapping[str, Any], i: int = 0) -> tuple[list, list]:
    """(image paths, video entries) of row `i` (1-based, for messages)."""
    def listed(key: str) -> list:
        v = row.get(key) or []
        if not isinstance(v, (str, dict, list, tuple)):
            raise SeqParError(f"row {i}: '{key}' must be a list of local files (or one), got {type(v).__name__} "
                              f"{v!r:.40}")
        return [v] if isinstance(v, (str, dict)) else list(v)

    return listed("images"), listed("videos")


# Rows with media for a text-only model (SFT, DPO and GRPO alike): nothing would embed them.
TEXT_ONLY = ("carries images/videos, but the model is text-only: they would be dropped and their <image> / <video> "
             "placeholders trained as text: drop the images / videos columns, or use a vision-language model "
             "(Qwen2.5-VL, Qwen3-VL)")


def carries_media(row: Mapping[str, Any], i: int = 0) -> bool:
    """Row `i` names images or videos (the `images` / `videos` columns, or a singular `image` / `video`)."""
    return any(media_columns(row, i)) or bool(row.get("image")) or bool(row.get("video"))


def refuse_media_rows(rows: Sequence[Mapping[str, Any]]) -> None:
    """SeqParError at the first row with images / videos (for a text-only model); rows are 1-based lines."""
    for i, row in enumerate(rows, 1):
        if carries_media(row, i):
            raise SeqParError(f"row {i} {TEXT_ONLY}")


def _video_tokens(spec: VisionSpec, tok: Any, grid: list[int], stamps: list[float]) -> list[int]:
    t, h, w = grid
    per = h * w // spec.merge ** 2
    if not spec.timestamps:
        return [spec.vision_start_id] + [spec.video_token_id] * (t * per) + [spec.vision_end_id]
    out: list[int] = []
    for s in stamps:
        out += tok.encode(f"<{s:.1f} seconds>") + [spec.vision_start_id] + [spec.video_token_id] * per + \
            [spec.vision_end_id]
    return out


def expand_media(ids: list[int], labels: list[int] | None, row: Mapping[str, Any], tok: Any, spec: VisionSpec,
                 base_dir: str, i: int) -> dict[str, Any]:
    """ids (tokenized from `with_markers(row, tok)`) with each placeholder marker replaced by its medium's tokens
    (unsupervised), plus the media tensors; labels None: no labels (GRPO prompts)."""
    images, videos = media_columns(row, i)
    found = []
    for placeholder, entries in ((PLACEHOLDER, images), (VIDEO_PLACEHOLDER, videos)):
        _, pattern = _marker_ids(tok, placeholder)
        starts = _find_all(ids, pattern)
        if len(starts) != len(entries):
            raise SeqParError(f"row {i}: {len(starts)} {placeholder} placeholders but {len(entries)} "
                              f"{'images' if placeholder == PLACEHOLDER else 'videos'}: put one {placeholder} in the "
                              "messages where each goes")
        found += [(at, len(pattern), placeholder, k) for k, at in enumerate(starts)]
    out: dict[str, Any] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    if images:
        pixels, grid = spec.encode_images([p if os.path.isabs(p) else os.path.join(base_dir, p) for p in images])
        out.update(pixel_values=pixels, image_grid_thw=grid)
        for k, n in enumerate((grid.prod(-1) // spec.merge ** 2).tolist()):
            tokens[(PLACEHOLDER, k)] = [spec.vision_start_id] + [spec.image_token_id] * n + [spec.vision_end_id]
    if videos:
        pixels, grid, seconds, stamps = spec.encode_videos(videos, base_dir)
        out.update(pixel_values_videos=pixels, video_grid_thw=grid, second_per_grid_ts=seconds)
        for k, g in enumerate(grid.tolist()):
            tokens[(VIDEO_PLACEHOLDER, k)] = _video_tokens(spec, tok, g, stamps[k])
    new_ids: list[int] = []
    new_labels: list[int] = []
    prev = 0
    for at, width, placeholder, k in sorted(found):
        media = tokens[(placeholder, k)]
        new_ids += ids[prev:at] + media
        new_labels += (labels[prev:at] if labels is not None else []) + [IGNORE] * len(media)
        prev = at + width
    out["input_ids"] = new_ids + ids[prev:]
    if labels is not None:
        out["labels"] = new_labels + labels[prev:]
    return out


def _vision_row(row: Mapping[str, Any], i: int, fmt: str, tok: Any, spec: VisionSpec, base_dir: str,
                train_on_prompt: bool, mask_history: bool) -> dict[str, Any]:
    out = tokenize_sft(with_markers(row, tok), fmt, tok, train_on_prompt=train_on_prompt,
                       mask_history=mask_history, index=i)
    return expand_media(out["input_ids"], out["labels"], row, tok, spec, base_dir, i)


def _last_media_token(ids: list[int], spec: VisionSpec) -> int:
    return max((j for j, t in enumerate(ids) if t == spec.vision_end_id), default=-1)


def build_vision_examples(rows: list[dict[str, Any]], fmt: str, tok: Any, spec: VisionSpec, max_length: int,
                          base_dir: str, *, train_on_prompt: bool = False, mask_history: bool = False,
                          packing: bool = False) -> tuple[list[Any], dict[str, int]]:
    """Tokenized rows with their media (see the module docstring) + the stats build_examples reports;
    packing: greedy packs of at most max_length tokens (lists of rows, media kept with their rows)."""
    if fmt == "auto":
        fmt = detect_format([c for c in rows[0] if c not in ("images", "videos")])
    check_stage(fmt, "sft")
    stats = new_stats(len(rows))
    examples = []
    for i, row in enumerate(rows, 1):  # 1-based: the line of a JSONL file
        ex = _vision_row(row, i, fmt, tok, spec, base_dir, train_on_prompt, mask_history)
        if len(ex["input_ids"]) > max_length:
            last = _last_media_token(ex["input_ids"], spec)
            if last >= max_length:
                raise SeqParError(f"row {i}: its images / videos end at token {last + 1}, beyond dataset.max_length="
                                  f"{max_length}: raise max_length (an image or video cannot be cut)")
            ex = {**ex, "input_ids": ex["input_ids"][:max_length], "labels": ex["labels"][:max_length]}
            stats["truncated"] += 1
        if not any(lab != IGNORE for lab in ex["labels"][1:]):
            stats["dropped_unsupervised"] += 1
            continue
        examples.append(ex)
    if not examples:
        raise SeqParError(f"no row keeps a supervised token within dataset.max_length={max_length}")
    return (pack_rows(examples, max_length) if packing else examples), stats


def build_vision_dpo_examples(rows: list[dict[str, Any]], fmt: str, tok: Any, spec: VisionSpec, max_length: int,
                              base_dir: str, *, max_prompt_length: int | None = None,
                              truncation_mode: str = "keep_end") -> tuple[list[Any], dict[str, int]]:
    """DPO pairs whose prompts carry images / videos (see the module docstring) + build_examples' stats."""
    if fmt == "auto":
        fmt = detect_format([c for c in rows[0] if c not in ("images", "videos")])
    check_stage(fmt, "dpo")
    stats = new_stats(len(rows))
    markers = [_marker_ids(tok, p)[1] for p in (PLACEHOLDER, VIDEO_PLACEHOLDER)]

    def encode(row: dict[str, Any], i: int) -> dict[str, Any]:
        ex = tokenize_dpo(with_markers(row, tok), tok, i)
        for side in ("chosen", "rejected"):
            if any(_find_all(ex[f"{side}_input_ids"], m) for m in markers):
                raise SeqParError(f"row {i}: the {side} response holds an {PLACEHOLDER} / {VIDEO_PLACEHOLDER} "
                                  "placeholder: put every image / video in the prompt (both responses answer it)")
        got = expand_media(ex["prompt_input_ids"], None, row, tok, spec, base_dir, i)
        n = len(got["input_ids"])
        if len(got) > 1 and max_prompt_length is not None and n > max_prompt_length:
            raise SeqParError(f"row {i}: its prompt holds images / videos and {n} tokens > dataset.max_prompt_length="
                              f"{max_prompt_length}: an image or video cannot be cut, raise max_prompt_length")
        ex["prompt_input_ids"] = got.pop("input_ids")
        return {**ex, **got}

    return build_dpo_pairs(rows, tok, max_length, max_prompt_length, truncation_mode, stats, encode), stats
