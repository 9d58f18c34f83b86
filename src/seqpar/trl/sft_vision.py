"""The TRL SFT drop-in with vision-language models (Qwen2.5-VL, Qwen3-VL): TRL builds the batch, seqpar shards it.

TRL (1.16) does not prepare a vision dataset (rows with an "image" / "images" column): per micro-batch its
DataCollatorForVisionLanguageModeling renders the messages or prompt / completion, runs the processor on the images
(expanding the placeholders) and builds the labels (padding -100; completion_only_loss / assistant_only_loss; the
image tokens left supervised, as stock TRL leaves them). seqpar's sampler gives every rank of an SP group the same
rows, so each rank builds the same full batch with TRL's own collator; `TRLVisionSFTCollator` then takes its rows
(unpadded by the attention mask) and images into seqpar.data.VisionCollator's batch: labels shifted on the full
sequence, the shards, the full input ids and the media for seqpar.hf.sp_vlm_inputs (images encoded once per SP
group). A text dataset on a VL model: TRL prepares it as for a text model, `TRLVLMTextCollator` collates it.

Refused (SeqParError naming the change, before any collective): video columns (TRL's SFT collator processes images
only) and packing / padding_free with images (TRL refuses both for vision datasets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..data import VisionCollator
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .args import first_row, refuse, refuse_video_columns
from .collators import TRLSFTCollator

__all__ = ["TRLVisionSFTCollator", "TRLVLMTextCollator", "check_sft_vision", "is_vision_dataset"]

_MEDIA = ("pixel_values", "image_grid_thw")  # what TRL's vision collator returns for a Qwen VL processor's images


def is_vision_dataset(dataset: Any) -> bool:
    """What trl.SFTTrainer reads as a vision dataset: its first row has an "image" or "images" key."""
    row = first_row(dataset)
    return "image" in row or "images" in row


def check_sft_vision(name: str, args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """Vision datasets the SFT drop-in cannot train as stock TRL would: a SeqParError naming what to change."""
    refuse_video_columns(name, "trl.SFTTrainer (1.16) trains on images only: its vision collator passes no videos "
                         "to the processor", "pass rows with the processor's output (input_ids, labels, "
                         "pixel_values_videos, video_grid_thw, second_per_grid_ts) to "
                         "seqpar.hf.SequenceParallelTrainer, or train with `seqpar train` (image / video datasets: "
                         "docs/hf.md)", train_dataset, eval_dataset)
    if not is_vision_dataset(train_dataset):
        return
    for flag in ("packing", "padding_free"):
        if getattr(args, flag, False):
            raise refuse(name, f"{flag}=True with an image dataset", "TRL builds vision batches per micro-batch "
                          "and packs no image rows (stock trl.SFTTrainer refuses it too)",
                          f"set {flag}=False (each row is padded only to the SP multiple), or train packed image "
                          "rows with `seqpar train` (packing: true)")


def _unpadded(batch: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
    """TRL's padded [B, S] input_ids / labels -> one row per sequence, without the attention mask's padding."""
    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    return [{"input_ids": ids[i][mask[i]], "labels": labels[i][mask[i]]} for i in range(ids.shape[0])]


class TRLVisionSFTCollator(VisionCollator):
    """TRL's DataCollatorForVisionLanguageModeling (the full micro-batch, identical on the SP ranks of a group),
    then seqpar's vision batch: shards, "full_input_ids" and the batch's images (see the module docstring)."""

    def __init__(self, trl_collator: Any, mesh: SequenceParallelMesh, pad_token_id: int) -> None:
        super().__init__(mesh, pad_token_id)  # no max_length: TRL's collator truncates (args.max_length)
        self.trl_collator = trl_collator

    def _full(self, rows: Sequence[Mapping[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if isinstance(rows, Mapping) or not isinstance(rows, Sequence) or not rows:
            raise SeqParError("the collator takes a non-empty list of dataset rows")
        batch = self.trl_collator([dict(r) for r in rows])  # TRL pops "image" from the rows it is given
        if batch.get("pixel_values_videos") is not None:
            raise SeqParError("TRL's vision batch holds videos: the SFT drop-in trains on images only")
        media = {k: batch[k] for k in _MEDIA if batch.get(k) is not None}
        return super().collate_full(_unpadded(batch)), media

    def collate_full(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        return self._full(rows)[0]

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        full, media = self._full(rows)
        out = self.shard_batch(full)
        out["full_input_ids"] = full["input_ids"]
        out.update(media)
        return out


class TRLVLMTextCollator(TRLSFTCollator, VisionCollator):
    """A vision-language model on text rows TRL prepared (input_ids, labels, seq_lengths when packed): TRLSFTCollator's
    rows, VisionCollator's batch without media, so the model gets its multimodal RoPE ids from sp_vlm_inputs."""
