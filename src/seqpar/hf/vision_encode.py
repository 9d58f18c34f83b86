"""Encoding a full batch's images and videos once per SP group, inside the model's forward.

`VisionRequest` is what `seqpar.hf.vision.sp_vlm_inputs` hands the model (keyword `VISION_KWARG`); the
pre-hook apply_sequence_parallel puts on the VL model turns it into `mm_encoder_outputs` there, so the vision
tower runs inside the model's forward (FSDP2's root forward, activation checkpointing and the memory meter see
it as part of the model). Media (images, then videos) are dealt to the SP ranks, largest first onto the least
loaded rank; each rank runs the tower ONCE on its media (one call for images and videos together) and the
merged embeddings (with Qwen3-VL's deepstack features) are all-gathered with a differentiable gather whose
backward sums every rank's gradient of an embedding onto its owner: after the usual gradient sum over SP ranks
each image counts once.

Models whose wrapper synchronises the tower's parameters or gradients over ranks (FSDP2 units, DeepSpeed
ZeRO-3 modules, DDP): every rank must run the tower's forward and backward the same number of times and hold
a gradient for the same parameters, or a parameter gather / gradient reduction would wait forever for (or
mismatch with) the ranks that own no media. Then ("joining") a rank without media, and every rank of a batch
without any, encodes one blank image of the smallest grid and takes zero rows of its output into the graph:
the tower's collectives run on every rank, the gradients it adds are exactly zero. Without such a wrapper
(seqpar's own gradient sum) a rank without media skips the tower.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .vision_rope import Media

__all__ = ["VISION_KWARG", "VisionRequest", "assign_images", "tower_must_join", "check_same_as", "blank_tower_pass"]

VISION_KWARG = "seqpar_vision"


def assign_images(patches: list[int], ranks: int) -> list[int]:
    """Owner rank of each image / video: largest first onto the least loaded rank (ties: lower rank).
    Deterministic, so every rank computes the same assignment from the same grids."""
    heap = [(0, r) for r in range(ranks)]
    owner = [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + patches[i], r))
    return owner


def check_same_as(media: Media, same_as: Any) -> list[int] | None:
    """`same_as` as a list, checked: one entry per medium (images, then videos), each naming itself or an earlier
    medium of the same kind that names itself, with the same grid and the same pixels (so reusing its embedding
    is exact). Raises SeqParError alike on every rank."""
    if same_as is None:
        return None
    same = [int(j) for j in torch.as_tensor(same_as).reshape(-1).tolist()]
    grids, n_img = media.grids, media.n_images
    if len(same) != len(grids):
        raise SeqParError(f"same_as names {len(same)} media but the batch holds {len(grids)} (images, then videos)")
    for i, j in enumerate(same):
        if j == i:
            continue
        if not (0 <= j < i and same[j] == j and (j < n_img) == (i < n_img) and grids[i] == grids[j]
                and torch.equal(media.patches(i), media.patches(j))):
            raise SeqParError(f"same_as[{i}] = {j}: a medium may only reuse an earlier, identical medium (same kind, "
                              "grid and pixels) that is encoded itself")
    return same


def tower_must_join(model: torch.nn.Module) -> bool:
    """Every rank runs the tower in every forward: the model (as called) is DDP-wrapped, holds FSDP2 units or
    DeepSpeed ZeRO-3 parameters (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return True
    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(hasattr(p, "ds_id")
                                                                          for p in model.parameters())


class VisionRequest:
    """The full batch's media and where this rank's shard needs their embeddings (see the module docstring).
    A plain class, not a dataclass: DDP / FSDP would rebuild a dataclass input field by field."""

    def __init__(self, mesh: SequenceParallelMesh, media: Media, image_rows: torch.Tensor,
                 video_rows: torch.Tensor, join: bool = False, same_as: list[int] | None = None) -> None:
        self.mesh, self.media, self.join = mesh, media, join
        self.image_rows, self.video_rows = image_rows, video_rows  # shard's image / video tokens: batch order
        # Medium i takes the embedding of medium same_as[i] (an identical earlier one): encoded once, its
        # gradient the sum over every place it appears (the gather's index repeats it).
        self.same_as = same_as
        self.encoded_patches = 0  # patches this rank ran through the tower (tests count them)

    def encode(self, vlm: torch.nn.Module) -> dict[str, Any]:
        """mm_encoder_outputs for the shard: {"image": ..., "video": ...} of the model's own output types."""
        cfg, mesh, media = vlm.config, self.mesh, self.media
        hidden = int(cfg.text_config.hidden_size)
        levels = len(getattr(cfg.vision_config, "deepstack_visual_indexes", None) or [])
        width = hidden * (1 + levels)
        merge = int(vlm.visual.spatial_merge_size) ** 2
        grids = media.grids
        if not grids:  # no media in the batch: a joining tower's empty rows, else nothing
            return {"image": _encoder_output(self._own_features(vlm, [], width), hidden, levels)} if self.join else {}
        same = self.same_as if self.same_as is not None else list(range(len(grids)))
        unique = [i for i, j in enumerate(same) if i == j]
        patches = [t * h * w for t, h, w in grids]
        tokens = [p // merge for p in patches]
        owner = dict(zip(unique, assign_images([patches[i] for i in unique], mesh.sp_size)))
        mine = self._own_features(vlm, [i for i in unique if owner[i] == mesh.sp_rank], width)
        block = max(sum(tokens[i] for i in unique if owner[i] == r) for r in range(mesh.sp_size))
        mine = torch.cat([mine.to(mesh.comm_device), mine.new_zeros(block - mine.shape[0], width,
                                                                     device=mesh.comm_device)])
        every = comm.all_gather(mine, mesh.sp_group, dim=0, stats=mesh.stats, device=mesh.comm_device)
        offset, start = [r * block for r in range(mesh.sp_size)], {}
        for i in unique:  # each rank's media, in media order (images, then videos)
            start[i] = offset[owner[i]]
            offset[owner[i]] += tokens[i]
        index = [k for i in range(len(grids)) for k in range(start[same[i]], start[same[i]] + tokens[i])]
        index = torch.tensor(index, dtype=torch.long, device=every.device)
        n_img_tok = sum(tokens[:media.n_images])
        out = {"image": _encoder_output(every[index[:n_img_tok][self.image_rows.to(every.device)]], hidden, levels)}
        if media.video_grid_thw is not None:
            out["video"] = _encoder_output(every[index[n_img_tok:][self.video_rows.to(every.device)]], hidden, levels)
        return out

    def _own_features(self, vlm: torch.nn.Module, own: list[int], width: int) -> torch.Tensor:
        """This rank's media through the vision tower: [own media tokens, width] (merged embedding and deepstack
        features side by side, one gather for all). A joining rank without media encodes a blank image."""
        device = next(vlm.visual.parameters()).device
        if own:
            pv = torch.cat([self.media.patches(i) for i in own]).to(device)
            grid = torch.tensor([self.media.grids[i] for i in own], dtype=torch.long)
            return self._tower(vlm, pv, grid)
        if self.join:
            return self._tower(vlm, *_blank_image(vlm, device))[:0]
        trains = torch.is_grad_enabled() and any(p.requires_grad for p in vlm.visual.parameters())
        # Not joining: an empty leaf (requiring grad when an owner's rows do) keeps the gather's backward matched.
        return torch.zeros(0, width, dtype=vlm.visual.dtype, device=device).requires_grad_(trains)

    def _tower(self, vlm: torch.nn.Module, pv: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        self.encoded_patches += int(pv.shape[0])
        out = vlm.get_image_features(pv, grid.to(pv.device), return_dict=True)  # videos too: the same tower
        parts = [torch.cat(out.pooler_output)]
        parts += [torch.cat(level) for level in (getattr(out, "deepstack_features", None) or [])]
        return torch.cat(parts, dim=-1)


def blank_tower_pass(vlm: torch.nn.Module) -> None:
    """The tower on one blank image, output dropped: a rank with no media of its own joins the others' tower
    collectives (FSDP2 unit gathers) in a generate() prefill (seqpar.hf.rollout_media)."""
    with torch.no_grad():
        pv, grid = _blank_image(vlm, next(vlm.visual.parameters()).device)
        vlm.get_image_features(pv, grid.to(pv.device), return_dict=True)


def _blank_image(vlm: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes: one merged patch of zeros."""
    vc = vlm.config.vision_config
    m = int(vc.spatial_merge_size)
    dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    return torch.zeros(m * m, dim, device=device), torch.tensor([[1, m, m]], dtype=torch.long)


def _encoder_output(rows: torch.Tensor, hidden: int, levels: int) -> Any:
    """The model's own vision-output type holding `rows` (one image / video entry)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    main = rows[:, :hidden]
    if not levels:
        return BaseModelOutputWithPooling(pooler_output=(main,))
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    deep = [(rows[:, hidden * (k + 1): hidden * (k + 2)],) for k in range(levels)]
    return BaseModelOutputWithDeepstackFeatures(pooler_output=(main,), deepstack_features=deep)
