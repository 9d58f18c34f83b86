"""Vision-language models (Qwen2.5-VL, Qwen3-VL) under sequence parallelism.

    model = apply_sequence_parallel(Qwen2_5_VLForConditionalGeneration(...), mesh)
    kw = sp_vlm_inputs(model, mesh, full_input_ids, pixel_values=pv, image_grid_thw=grid)  # the FULL batch
    logits = model(**kw).logits                  # this rank's shard, as for a text model
    loss = seqpar.loss.sft_loss(logits, seqpar.shard(full_shift_labels, mesh), num_items)

Every rank of an SP group holds the same full batch (token ids, images, videos); `sp_vlm_inputs` then
- computes the multimodal RoPE ids with the model's own `get_rope_index` on the FULL sequence, one document at
  a time (packed rows: `cu_seqlens=` / restarting `position_ids=`; seqpar.hf.vision_rope), prepends the text
  positions (row 0: what the ForwardPlan and the causal mask read) and shards the [4, B, S] ids;
- hands the model a `VisionRequest` (seqpar.hf.vision_encode): inside the model's forward, the pre-hook
  installed by apply_sequence_parallel encodes each image / video ONCE over the SP group and gives the model's
  own merge (masked_scatter, deepstack addition) exactly the embeddings of the shard's image / video tokens.
  Image and video tokens may fall on any shard seam. Under FSDP2, ZeRO-3 or DDP the tower runs on every rank in
  every forward (a blank image where a rank owns none), so its collectives always match. `same_as=` marks media
  that repeat an earlier one (DPO: the rejected rows' prompt media are the chosen rows'): encoded once, their
  embedding used at every place, its gradient summed over them.

Refused (clear errors): calling the model under SP with pixel_values / videos (it would encode every image and
merge them into a shard), position ids that are not [4, B, S_local], placeholders that do not match the media.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import SeqParError
from ..layout import check_length, shard
from ..mesh import SequenceParallelMesh
from ..unwrap import unwrapped_base
from .vision_encode import VISION_KWARG, VisionRequest, assign_images, check_same_as, tower_must_join
from .vision_rope import Media, check_media, mrope_positions

__all__ = ["VLM_TYPES", "is_vlm", "is_vlm_model", "check_vlm", "sp_vlm_inputs", "assign_images", "vision_batch_inputs",
           "vision_pre_hook", "Media"]

VLM_TYPES = ("qwen2_5_vl", "qwen3_vl")
_HOW = "seqpar.hf.sp_vlm_inputs(model, mesh, input_ids, pixel_values=..., image_grid_thw=...)"


def is_vlm(cfg: Any) -> bool:
    return getattr(cfg, "vision_config", None) is not None and getattr(cfg, "text_config", None) is not None


def is_vlm_model(model: torch.nn.Module) -> bool:
    """is_vlm of the model's config, through PEFT, DDP and DeepSpeed wrappers."""
    return is_vlm(getattr(unwrapped_base(model), "config", None))


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
                f"image / video and merge it into this rank's shard. Pass the full batch to {_HOW} (videos: "
                "pixel_values_videos=, video_grid_thw=) and call the model with what it returns"
            )
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 3 or pos.shape[0] != 4:
        raise SeqParError(
            "a sequence-parallel vision-language model needs position_ids [4, B, S_local] (text positions, then "
            f"the multimodal RoPE ids computed on the FULL sequence): use {_HOW}"
        )




def vision_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The VL model's forward pre-hook under SP: refuses unsharded media, and encodes the media of a
    VisionRequest (from sp_vlm_inputs) here, inside the model's forward (seqpar.hf.vision_encode)."""
    request = kwargs.pop(VISION_KWARG, None)
    refuse_unsharded_vision(kwargs)
    if request is not None:
        if kwargs.get("mm_encoder_outputs") is not None:
            raise SeqParError("give either the VisionRequest of sp_vlm_inputs or mm_encoder_outputs, not both")
        outputs = request.encode(module)
        if outputs:
            kwargs["mm_encoder_outputs"] = outputs
    return args, kwargs


def _text_positions(b: int, s: int, device: torch.device, position_ids: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """[B, S] text positions of the FULL batch: given, from packed documents' cu_seqlens, or 0..S-1."""
    if position_ids is not None:
        pos = position_ids.to(device).long()
        if pos.dim() == 1:
            pos = pos[None]
        if tuple(pos.shape[-1:]) != (s,) or pos.shape[0] not in (1, b):
            raise SeqParError(f"position_ids must be the FULL batch's [B, S]=[{b}, {s}], got {tuple(pos.shape)}")
        return pos.expand(b, s)
    if cu_seqlens is not None:
        if b != 1:
            raise SeqParError(f"cu_seqlens (packed documents) needs batch size 1, got B={b}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != s:
            raise SeqParError(f"cu_seqlens must run from 0 to the full length {s}, got {cu}")
        return torch.cat([torch.arange(hi - lo) for lo, hi in zip(cu[:-1], cu[1:])]).to(device)[None]
    return torch.arange(s, device=device).expand(b, s)


def sp_vlm_inputs(model: torch.nn.Module, mesh: SequenceParallelMesh | None, input_ids: torch.Tensor,
                  pixel_values: torch.Tensor | None = None, image_grid_thw: torch.LongTensor | None = None,
                  attention_mask: torch.Tensor | None = None, *, pixel_values_videos: torch.Tensor | None = None,
                  video_grid_thw: torch.LongTensor | None = None, second_per_grid_ts: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  same_as: Any = None) -> dict[str, Any]:
    """This rank's keyword arguments for `model(**kw)` from the FULL batch (identical on every rank of the SP
    group): input_ids / position_ids / attention_mask shards, cu_seqlens (packed rows, passed on), and the
    VisionRequest the model's pre-hook encodes the media with. mesh=None: the mesh SP was applied with.
    Packed rows (B = 1): cu_seqlens= or position_ids= restarting at each document; every document's multimodal
    RoPE ids restart too. Videos: pixel_values_videos / video_grid_thw (+ Qwen2.5-VL's second_per_grid_ts,
    seconds per temporal patch; Qwen3-VL reads the timestamps written in the text). same_as: per medium (images,
    then videos) the index of an earlier identical one whose embedding it reuses, or its own (DPO: a rejected
    row repeats its chosen row's prompt media, encoded once). See the module docstring."""
    base = unwrapped_base(model)
    state = getattr(base, "_seqpar_state", None)
    if state is None or not is_vlm(base.config):
        raise SeqParError("sp_vlm_inputs needs a Qwen VL model with apply_sequence_parallel(model, mesh) applied")
    mesh = mesh if mesh is not None else state.mesh
    vlm = base.model
    if input_ids.dim() != 2:
        raise SeqParError(f"input_ids must be the FULL batch [B, S], got shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    check_length(int(s), mesh)
    media = Media(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                  None if second_per_grid_ts is None else torch.as_tensor(second_per_grid_ts, dtype=torch.float32))
    check_media(vlm.config, input_ids, media)
    same = check_same_as(media, same_as)
    text = _text_positions(b, s, input_ids.device, position_ids, cu_seqlens)
    mrope = mrope_positions(vlm, input_ids, text, media, attention_mask)
    kw: dict[str, Any] = {"input_ids": shard(input_ids, mesh, 1),
                          "position_ids": shard(torch.cat([text[None], mrope.to(text.device)]), mesh, 2)}
    if attention_mask is not None:
        kw["attention_mask"] = shard(attention_mask, mesh, 1)
    if cu_seqlens is not None:
        kw["cu_seqlens"] = cu_seqlens
    local = {}
    for name, token in (("image", vlm.config.image_token_id), ("video", vlm.config.video_token_id)):
        mask = input_ids == token
        order = mask.flatten().cumsum(0).view(b, s) - 1  # row of each media token among the batch's
        local[name] = shard(order, mesh, 1)[shard(mask, mesh, 1)]
    kw[VISION_KWARG] = VisionRequest(mesh, media, local["image"], local["video"], tower_must_join(model), same)
    return kw


def vision_batch_inputs(model: torch.nn.Module, batch: dict[str, Any], device: torch.device | str | None) -> dict:
    """Model kwargs for a collated vision batch (seqpar.data.VisionCollator / VisionDPOCollator: the FULL input ids,
    the media, cu_seqlens for packed rows, media_same_as for DPO pairs): sp_vlm_inputs on the mesh SP was applied
    with. Installed by apply_sequence_parallel as the model's seqpar.unwrap.BATCH_INPUTS_HOOK, which
    seqpar.steps.model_inputs calls."""
    def move(key: str) -> Any:
        t = batch.get(key)
        return t.to(device) if t is not None and device is not None and key.startswith("pixel") else t

    kw = sp_vlm_inputs(model, None, batch["full_input_ids"].to(device) if device is not None else
                       batch["full_input_ids"], pixel_values=move("pixel_values"),
                       image_grid_thw=batch.get("image_grid_thw"), pixel_values_videos=move("pixel_values_videos"),
                       video_grid_thw=batch.get("video_grid_thw"), second_per_grid_ts=batch.get("second_per_grid_ts"),
                       cu_seqlens=batch.get("cu_seqlens"), same_as=batch.get("media_same_as"))
    return {**kw, "use_cache": False}
