"""The media of a full vision-language batch: checks, and the multimodal RoPE ids per document.

Qwen2.5-VL / Qwen3-VL place an image or a video as a run of placeholder tokens (one per merged patch) whose
RoPE ids share temporal / height / width positions, so the ids depend on the whole document before them: they
are computed here on the FULL sequence, with the model's own `get_rope_index`, one document at a time (a packed
row restarts them at every document, as the same documents unpacked would). Qwen2.5-VL spaces a video's
temporal ids by `second_per_grid_ts` (seconds per temporal patch); Qwen3-VL writes a timestamp before each
frame group instead, so each temporal patch of a video is its own run of tokens (`<t s><start> ... <end>`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.sequence import document_starts
from ..errors import SeqParError

__all__ = ["Media", "check_media", "mrope_positions", "runs"]

# GRPO: a sampler that may draw a placeholder id puts one in a completion, which has no media to embed.
SAMPLED_HINT = (". In GRPO, a completion holding the model's image/video placeholder id cannot be trained (it brings "
                "no media): sample with seqpar.hf.generation.generate_for_group or sample_rows, which never draw these "
                "ids (seqpar train uses them; stock TRL's GRPOTrainer suppresses the image id), or pass "
                "suppress_tokens=[image_token_id, video_token_id] to your own generate()")


@dataclass
class Media:
    """A full batch's images and videos (the processor's tensors; None where absent)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None  # Qwen2.5-VL: seconds per temporal patch, one per video

    @property
    def grids(self) -> list[list[int]]:
        """(t, h, w) of every image, then every video: the order the vision tower encodes them in."""
        return [g for grid in (self.image_grid_thw, self.video_grid_thw) if grid is not None for g in grid.tolist()]

    @property
    def n_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    def patches(self, i: int) -> torch.Tensor:
        """The patch rows of media i (images first, then videos)."""
        if i < self.n_images:
            pixels, grid, j = self.pixel_values, self.image_grid_thw, i
        else:
            pixels, grid, j = self.pixel_values_videos, self.video_grid_thw, i - self.n_images
        start = int(grid[:j].prod(-1).sum()) if j else 0
        return pixels[start:start + int(grid[j].prod())]


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of every run of True in a 1-D bool tensor."""
    m = mask.to(torch.int8)
    edges = torch.diff(torch.cat([m.new_zeros(1), m, m.new_zeros(1)]))
    return list(zip(torch.nonzero(edges == 1).flatten().tolist(), torch.nonzero(edges == -1).flatten().tolist()))


def _check_kind(name: str, ids: torch.Tensor, token: int, pixels: torch.Tensor | None, grid: torch.Tensor | None,
                merge: int, per_frame: bool) -> None:
    if (pixels is None) != (grid is None):
        raise SeqParError(f"give {name} pixels and their grid together (or neither)")
    n_tok = int((ids == token).sum())
    want = 0 if grid is None else int((grid.prod(-1) // merge).sum())
    if n_tok != want:
        what = "image_grid_thw" if name == "image" else "video_grid_thw"
        raise SeqParError(
            f"input_ids hold {n_tok} {name} tokens but {what} describes {want} merged patches: the processor's "
            f"expansion of each {name} placeholder and the {name}s must match (no truncation inside one)"
            f"{SAMPLED_HINT}")
    if grid is None:
        return
    if int(grid.prod(-1).sum()) != int(pixels.shape[0]):
        raise SeqParError(f"{name} pixels have {pixels.shape[0]} patches, the grid says {int(grid.prod(-1).sum())}")
    n_runs = sum(len(runs(row == token)) for row in ids)
    want_runs = int(grid[:, 0].sum()) if per_frame else int(grid.shape[0])
    if n_runs != want_runs:
        layout = ("one run of video tokens per temporal patch, each preceded by its timestamp and framed by vision "
                  "start / end (Qwen3-VL's processor layout)" if per_frame else
                  f"one contiguous run of tokens per {name}, framed by vision start / end")
        raise SeqParError(f"input_ids hold {n_runs} runs of {name} tokens for {want_runs} expected: expand each "
                          f"{name} as {layout}")


def check_media(cfg, input_ids: torch.Tensor, media: Media) -> None:
    """The placeholders of the FULL batch match its media (tokens per grid, one run per image / video or frame
    group); raises SeqParError alike on every rank."""
    merge = int(cfg.vision_config.spatial_merge_size) ** 2
    _check_kind("image", input_ids, cfg.image_token_id, media.pixel_values, media.image_grid_thw, merge, False)
    per_frame = cfg.model_type == "qwen3_vl"
    _check_kind("video", input_ids, cfg.video_token_id, media.pixel_values_videos, media.video_grid_thw, merge,
                per_frame)
    ts = media.second_per_grid_ts
    if ts is not None and (media.video_grid_thw is None or len(ts) != int(media.video_grid_thw.shape[0])):
        raise SeqParError("second_per_grid_ts needs one value per video (video_grid_thw rows)")


def _doc_spans(text_pos: torch.Tensor) -> list[tuple[int, int]]:
    starts = torch.nonzero(document_starts(text_pos)).flatten().tolist() + [int(text_pos.numel())]
    return list(zip(starts[:-1], starts[1:]))


def mrope_positions(vlm: torch.nn.Module, input_ids: torch.Tensor, text_pos: torch.Tensor, media: Media,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[3, B, S] multimodal RoPE ids of the FULL batch: the model's get_rope_index per document (documents
    start where the text positions restart), each document's images / videos in batch order."""
    cfg = vlm.config
    img_tok, vid_tok = cfg.image_token_id, cfg.video_token_id
    per_frame = cfg.model_type == "qwen3_vl"
    b, s = input_ids.shape
    out = torch.empty(3, b, s, dtype=torch.long, device=input_ids.device)
    ni = nv = 0  # images / videos consumed so far
    for r in range(b):
        for lo, hi in _doc_spans(text_pos[r]):
            ids = input_ids[r, lo:hi]
            k_img = len(runs(ids == img_tok))
            k_vid_runs = len(runs(ids == vid_tok))
            if not k_img and not k_vid_runs:
                out[:, r, lo:hi] = torch.arange(hi - lo, device=out.device)
                continue
            k_vid = _videos_in(media, nv, k_vid_runs) if per_frame and k_vid_runs else k_vid_runs
            types = (ids == img_tok).int() + 2 * (ids == vid_tok).int()
            kw = {}
            if k_img:
                kw["image_grid_thw"] = media.image_grid_thw[ni:ni + k_img]
            if k_vid:
                kw["video_grid_thw"] = media.video_grid_thw[nv:nv + k_vid]
                if media.second_per_grid_ts is not None:
                    kw["second_per_grid_ts"] = media.second_per_grid_ts[nv:nv + k_vid]
            mask = attention_mask[r:r + 1, lo:hi] if attention_mask is not None else None
            pos, _ = vlm.get_rope_index(ids[None], mm_token_type_ids=types[None], attention_mask=mask, **kw)
            out[:, r, lo:hi] = pos[:, 0].to(out.device)
            ni, nv = ni + k_img, nv + k_vid
    return out


def _videos_in(media: Media, first: int, frame_runs: int) -> int:
    """Qwen3-VL: how many whole videos, from video `first` on, the document's `frame_runs` runs make."""
    t = media.video_grid_thw[:, 0].tolist()
    k, seen = 0, 0
    while seen < frame_runs:
        if first + k >= len(t):
            break
        seen += t[first + k]
        k += 1
    if seen != frame_runs:
        raise SeqParError(f"a document holds {frame_runs} video frame groups, which do not end with a video (a "
                          "packed row or a cut may not split a video)")
    return k
