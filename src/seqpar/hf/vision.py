"""Vision-language models (Qwen2.5-VL, Qwen3-VL) under sequence parallelism.

    model = apply_sequence_parallel(Qwen2_5_VLForConditionalGeneration(...), mesh)
    kw = sp_vlm_inputs(model, mesh, full_input_ids, pixel_values=pv, image_grid_thw=grid)  # the FULL batch
    logits = model(**kw).logits                  # this rank's shard, as for a text model
    loss = seqpar.loss.sft_loss(logits, seqpar.shard(full_shift_labels, mesh), num_items)

Every rank of an SP group holds the same full batch (token ids, images); `sp_vlm_inputs` then
- computes the multimodal RoPE ids with the model's own `get_rope_index` on the FULL sequence (image
  positions are not previous + 1, so they cannot be computed per shard), prepends the text positions
  (row 0: 0..S-1, what the ForwardPlan and the causal mask read) and shards the [4, B, S] ids;
- runs the vision tower ONCE per image over the SP group: images are dealt to the ranks (largest first,
  to the least loaded rank), each rank encodes its own, and the merged image embeddings (with Qwen3-VL's
  deepstack features) are all-gathered with a differentiable gather whose backward sums each embedding's
  gradient from every rank back onto its owner, so the vision tower's gradients are exact after the usual
  SP gradient sum (each image contributes on exactly one rank);
- gives the model this rank's token shard and, through `mm_encoder_outputs`, the embeddings of exactly the
  image tokens in it (in order), so the model's own merge (masked_scatter, deepstack addition) runs on the
  shard. Image tokens may fall on any shard boundary.

Not supported (clear errors): videos, packed documents (per-document multimodal RoPE), and calling the
model under SP with pixel_values (the model would encode every image and merge them into a shard).
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from .. import comm
from ..errors import SeqParError
from ..layout import check_length, shard
from ..mesh import SequenceParallelMesh
from ..unwrap import base_model

__all__ = ["VLM_TYPES", "is_vlm", "check_vlm", "sp_vlm_inputs", "assign_images", "vision_batch_inputs"]

VLM_TYPES = ("qwen2_5_vl", "qwen3_vl")
_HOW = "seqpar.hf.vision.sp_vlm_inputs(model, mesh, input_ids, pixel_values=..., image_grid_thw=...)"


def is_vlm(cfg: Any) -> bool:
    return getattr(cfg, "vision_config", None) is not None and getattr(cfg, "text_config", None) is not None


def check_vlm(cfg: Any) -> Any:
    """The text config of a supported VLM; refuses other multimodal configs."""
    if getattr(cfg, "model_type", None) not in VLM_TYPES:
        raise SeqParError(
            f"multimodal model {getattr(cfg, 'model_type', type(cfg).__name__)!r} is not supported under SP "
            f"(supported vision-language models: {', '.join(VLM_TYPES)}): apply SP to its text causal LM "
            "(e.g. model.language_model with its own lm_head) or train without SP"
        )
    return cfg.text_config


def vlm_language_model(base: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack inside a Qwen VL model (what receives the merged embeddings and position ids)."""
    return base.model.language_model


def refuse_unsharded_vision(kwargs: dict) -> None:
    """Called on the VL model's inputs under SP: images and positions must come from sp_vlm_inputs."""
    for key in ("pixel_values", "pixel_values_videos", "video_grid_thw"):
        if kwargs.get(key) is not None:
            raise SeqParError(
                f"{key}= was passed to a sequence-parallel vision-language model: the model would encode every "
                f"image and merge it into this rank's shard. Pass the full batch to {_HOW} and call the model "
                "with what it returns (videos are not supported under SP)"
            )
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 3 or pos.shape[0] != 4:
        raise SeqParError(
            "a sequence-parallel vision-language model needs position_ids [4, B, S_local] (text positions, then "
            f"the multimodal RoPE ids computed on the FULL sequence): use {_HOW}"
        )


def assign_images(patches: list[int], ranks: int) -> list[int]:
    """Owner rank of each image: largest first onto the least loaded rank (ties: lower rank). Deterministic,
    so every rank computes the same assignment from the same grid."""
    heap = [(0, r) for r in range(ranks)]
    owner = [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + patches[i], r))
    return owner


def _own_features(vlm: torch.nn.Module, pixel_values: torch.Tensor, grid: torch.Tensor, own: list[int],
                  width: int) -> torch.Tensor:
    """This rank's images through the vision tower: [own image tokens, width] with the merged embedding and
    the deepstack features side by side (one gather for all of them)."""
    if not own:
        # A rank without images still joins the gather's backward (a reduce-scatter every rank must enter):
        # its empty input needs a gradient whenever an owner's does (a trainable vision tower).
        trains = any(p.requires_grad for p in vlm.visual.parameters())
        return pixel_values.new_zeros(0, width, dtype=vlm.visual.dtype).requires_grad_(trains)
    starts = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
    pv = torch.cat([pixel_values[starts[i]:starts[i + 1]] for i in own])
    out = vlm.get_image_features(pv, grid[own], return_dict=True)
    parts = [torch.cat(out.pooler_output)]
    parts += [torch.cat(level) for level in (getattr(out, "deepstack_features", None) or [])]
    return torch.cat(parts, dim=-1)


def _image_embeddings(vlm: torch.nn.Module, mesh: SequenceParallelMesh, pixel_values: torch.Tensor,
                      grid: torch.Tensor, hidden: int, levels: int) -> torch.Tensor:
    """[all image tokens of the batch, hidden * (1 + levels)] in image order, each image encoded once in the
    SP group; differentiable (the gather's backward sums every rank's gradient onto the owner)."""
    merge = int(vlm.visual.spatial_merge_size) ** 2
    patches = grid.prod(-1).tolist()
    tokens = [p // merge for p in patches]
    owner = assign_images(patches, mesh.sp_size)
    rank = mesh.sp_rank
    width = hidden * (1 + levels)
    device = next(vlm.visual.parameters()).device
    mine = _own_features(vlm, pixel_values.to(device), grid, [i for i, o in enumerate(owner) if o == rank], width)
    mine = mine.to(mesh.comm_device)
    rows = [sum(t for t, o in zip(tokens, owner) if o == r) for r in range(mesh.sp_size)]
    block = max(rows)
    mine = torch.cat([mine, mine.new_zeros(block - mine.shape[0], width)])  # equal blocks for the gather
    every = comm.all_gather(mine, mesh.sp_group, dim=0, stats=mesh.stats, device=mesh.comm_device)
    offset = [r * block for r in range(mesh.sp_size)]
    index = []
    for t, o in zip(tokens, owner):
        index.extend(range(offset[o], offset[o] + t))
        offset[o] += t
    return every[torch.tensor(index, dtype=torch.long, device=every.device)]


# GRPO: a text-only policy can sample a placeholder id; the forward cannot embed a placeholder without its media.
_SAMPLED_HINT = (". In GRPO, this happens when a completion samples the model's image/video placeholder token: "
                 "such a rollout cannot be trained (lower the temperature, top_p or top_k so these ids are not drawn)")


def _check_batch(vlm: torch.nn.Module, mesh: SequenceParallelMesh, input_ids: torch.Tensor,
                 pixel_values: torch.Tensor | None, grid: torch.Tensor | None) -> None:
    cfg = vlm.config
    if input_ids.dim() != 2:
        raise SeqParError(f"input_ids must be the FULL batch [B, S], got shape {tuple(input_ids.shape)}")
    check_length(int(input_ids.shape[1]), mesh)
    if bool((input_ids == cfg.video_token_id).any()):
        raise SeqParError(f"video tokens (id {cfg.video_token_id}) in input_ids: videos are not supported under SP "
                          f"(images are){_SAMPLED_HINT}")
    n_tok = int((input_ids == cfg.image_token_id).sum())
    if (pixel_values is None) != (grid is None):
        raise SeqParError("give pixel_values and image_grid_thw together (or neither)")
    merge = int(cfg.vision_config.spatial_merge_size) ** 2
    want = 0 if grid is None else int((grid.prod(-1) // merge).sum())
    if n_tok != want:
        raise SeqParError(
            f"input_ids hold {n_tok} image tokens but image_grid_thw describes {want} merged patches: the "
            "processor's expansion of each image placeholder and the images must match (no truncation inside "
            f"an image){_SAMPLED_HINT}"
        )
    if grid is not None and int(grid.prod(-1).sum()) != int(pixel_values.shape[0]):
        raise SeqParError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw says "
                          f"{int(grid.prod(-1).sum())}")


def sp_vlm_inputs(model: torch.nn.Module, mesh: SequenceParallelMesh | None, input_ids: torch.Tensor,
                  pixel_values: torch.Tensor | None = None, image_grid_thw: torch.LongTensor | None = None,
                  attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """This rank's keyword arguments for `model(**kw)` from the FULL batch (identical on every rank of
    the SP group): input_ids / position_ids / attention_mask shards and the image embeddings of the
    shard's image tokens (`mm_encoder_outputs`). mesh=None: the mesh SP was applied with. See the module
    docstring."""
    base = base_model(model)
    state = getattr(base, "_seqpar_state", None)
    if state is None or not is_vlm(base.config):
        raise SeqParError("sp_vlm_inputs needs a Qwen VL model with apply_sequence_parallel(model, mesh) applied")
    mesh = mesh if mesh is not None else state.mesh
    vlm = base.model
    _check_batch(vlm, mesh, input_ids, pixel_values, image_grid_thw)
    b, s = input_ids.shape
    image_mask = input_ids == vlm.config.image_token_id
    text = torch.arange(s, device=input_ids.device).expand(b, s)
    if pixel_values is not None:
        mrope, _ = vlm.get_rope_index(input_ids, mm_token_type_ids=image_mask.int(), image_grid_thw=image_grid_thw,
                                      attention_mask=attention_mask)
    else:
        mrope = text[None].expand(3, b, s)
    kw: dict[str, Any] = {"input_ids": shard(input_ids, mesh, 1),
                          "position_ids": shard(torch.cat([text[None], mrope.to(text.device)]), mesh, 2)}
    if attention_mask is not None:
        kw["attention_mask"] = shard(attention_mask, mesh, 1)
    if pixel_values is None:
        return kw
    hidden = int(vlm.config.text_config.hidden_size)
    levels = len(getattr(vlm.config.vision_config, "deepstack_visual_indexes", None) or [])
    every = _image_embeddings(vlm, mesh, pixel_values, image_grid_thw, hidden, levels)
    order = image_mask.flatten().cumsum(0).view(b, s) - 1  # row of each image token in `every`
    local = shard(order, mesh, 1)[shard(image_mask, mesh, 1)]
    mine = every[local.to(every.device)]
    return {**kw, "mm_encoder_outputs": {"image": _encoder_output(mine, hidden, levels)}}


def vision_batch_inputs(model: torch.nn.Module, batch: dict[str, Any], device: torch.device | str | None) -> dict:
    """Model kwargs for a collated vision batch (train.dataset.images.VisionCollator: the FULL input ids and
    the images): sp_vlm_inputs on the mesh SP was applied with. Installed by apply_sequence_parallel as the
    model's seqpar.unwrap.BATCH_INPUTS_HOOK, which seqpar.steps.model_inputs calls."""
    move = (lambda t: t.to(device)) if device is not None else (lambda t: t)  # noqa: E731
    pixels = batch.get("pixel_values")
    kw = sp_vlm_inputs(model, None, move(batch["full_input_ids"]), pixel_values=move(pixels) if pixels is not None
                       else None, image_grid_thw=batch.get("image_grid_thw"))
    return {**kw, "use_cache": False}


def _encoder_output(rows: torch.Tensor, hidden: int, levels: int) -> Any:
    """The model's own vision-output type, holding this shard's image-token embeddings (one 'image')."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    main = rows[:, :hidden]
    if not levels:
        return BaseModelOutputWithPooling(pooler_output=(main,))
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    deep = [(rows[:, hidden * (k + 1): hidden * (k + 2)],) for k in range(levels)]
    return BaseModelOutputWithDeepstackFeatures(pooler_output=(main,), deepstack_features=deep)
