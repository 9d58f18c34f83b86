"""Videos for `seqpar train` on Qwen2.5-VL / Qwen3-VL: local frame folders (or animated GIFs), their patches and
timing.

A dataset row's `videos` column lists, per `<video>` placeholder, a folder of frames (image files, taken in
file-name order as already sampled), a GIF file (PIL decodes it: no video library needed), or a dict
`{"path": ..., "fps": 2.0}`. `fps` (frames per second of the given frames; default 2.0, Qwen's sampling
rate, or a GIF's own frame duration) gives the timing: Qwen2.5-VL's `second_per_grid_ts` (= temporal patch
/ fps, which spaces the temporal RoPE ids) and Qwen3-VL's `<t seconds>` timestamp before each temporal patch's
tokens (the middle of its frames, as the Qwen3-VL processor writes it). Other video files (mp4, webm, ...)
would need a video decoder (torchvision / PyAV / decord), which seqpar does not depend on: they are refused,
naming frame folders.

Patches: every frame through the model's image processor (the same resizing and normalisation as images, one
frame per patch in time), then `temporal_patch_size` consecutive frames side by side per patch -- the layout
of transformers' Qwen2-VL video processor (a frame count that is not a multiple repeats the last frame).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...errors import SeqParError

__all__ = ["FRAME_SUFFIXES", "read_frames", "video_patches", "frame_timestamps"]

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
DEFAULT_FPS = 2.0
_VIDEO_FILES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".m4v", ".mpeg", ".mpg")


def _spec(entry: Any, base_dir: str) -> tuple[str, float | None]:
    if isinstance(entry, dict):
        if "path" not in entry:
            raise SeqParError(f"a video entry must be a path or {{'path': ..., 'fps': ...}}, got {entry!r}")
        path, fps = entry["path"], entry.get("fps")
    else:
        path, fps = entry, None
    if fps is not None and (not isinstance(fps, (int, float)) or fps <= 0):
        raise SeqParError(f"video {path!r}: fps must be a positive number, got {fps!r}")
    return (path if os.path.isabs(path) else os.path.join(base_dir, path)), fps


def read_frames(entry: Any, base_dir: str) -> tuple[list, float]:
    """(RGB PIL frames, fps) of one `videos` entry (see the module docstring)."""
    from PIL import Image, ImageSequence

    path, fps = _spec(entry, base_dir)
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.lower().endswith(FRAME_SUFFIXES))
        if not names:
            raise SeqParError(f"video folder {path!r} holds no frames ({', '.join(FRAME_SUFFIXES)} files)")
        frames = []
        for n in names:
            try:
                with Image.open(os.path.join(path, n)) as im:
                    frames.append(im.convert("RGB"))
            except (OSError, ValueError) as e:
                raise SeqParError(f"cannot read frame {os.path.join(path, n)!r}: {e}") from None
        return frames, float(fps or DEFAULT_FPS)
    if path.lower().endswith(".gif") and os.path.isfile(path):
        with Image.open(path) as im:
            frames = [f.convert("RGB") for f in ImageSequence.Iterator(im)]
            ms = im.info.get("duration") or 0
        return frames, float(fps or (1000.0 / ms if ms else DEFAULT_FPS))
    if path.lower().endswith(_VIDEO_FILES):
        raise SeqParError(f"video file {path!r}: decoding it needs a video library (torchvision / PyAV / decord) that "
                          "seqpar does not use. Extract its frames into a folder (e.g. `ffmpeg -i clip.mp4 -vf fps=2 "
                          "clip/%05d.png`) and give the folder (with {'path': 'clip', 'fps': 2}); GIF files work as is")
    raise SeqParError(f"video {path!r} is neither a folder of frames nor a GIF file (or does not exist)")


def video_patches(processor: Any, frames: list, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """(patches [t * h * w, C * temporal * p * p], grid [t, h, w]) of one video's frames."""
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise SeqParError(f"the frames of a video must share one size, got {sorted(sizes)}")
    if len(frames) % temporal:
        frames = frames + [frames[-1]] * (temporal - len(frames) % temporal)
    out = processor(images=frames, temporal_patch_size=1, return_tensors="pt")
    per_frame, grid = out["pixel_values"], out["image_grid_thw"][0]
    n, d = int(grid[1] * grid[2]), per_frame.shape[-1]
    p = int(round((d // 3) ** 0.5))
    x = per_frame.view(len(frames) // temporal, temporal, n, 3, p, p).permute(0, 2, 3, 1, 4, 5)
    return x.reshape(len(frames) // temporal * n, 3 * temporal * p * p), [len(frames) // temporal, int(grid[1]),
                                                                             int(grid[2])]


def frame_timestamps(n_frames: int, fps: float, temporal: int) -> list[float]:
    """Qwen3-VL's timestamp of each temporal patch: the mean time of its first and last frame."""
    idx = list(range(n_frames))
    if n_frames % temporal:
        idx += [idx[-1]] * (temporal - n_frames % temporal)
    t = [i / fps for i in idx]
    return [(t[i] + t[i + temporal - 1]) / 2 for i in range(0, len(t), temporal)]
