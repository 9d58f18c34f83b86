"""Videos and packed rows of Qwen2.5-VL / Qwen3-VL under SP (seqpar.hf.sp_vlm_inputs), against the unmodified
model on one process (tests/vlm_cases.py).

- videos: B=2 rows of 64 tokens with a video and an image each (Qwen2.5-VL: one run of video tokens per video,
  temporal RoPE ids spaced by second_per_grid_ts; Qwen3-VL: one run per temporal patch after its timestamp),
  media across shard seams;
- packed: one row of four conversations (images, a video, text only) + padding, cu_seqlens; the reference runs
  each conversation ALONE (B=1): per-document multimodal RoPE ids and attention, no target across a boundary.

Compared: the loss (global supervised-token mean) and EVERY parameter gradient (vision tower, mergers, decoder,
head) after the SP gradient sum. Tolerance: fp32, 1e-5 absolute on both. Each image / video is encoded once in
the SP group (patches counted per rank).
"""

from __future__ import annotations

import pytest
import torch
from vlm_cases import SECONDS, VIDEO, Doc, media_kwargs, packed_batch, reference, rows_batch

import seqpar
from seqpar import loss as L
from seqpar.errors import SeqParError
from seqpar.hf import apply_sequence_parallel, sp_vlm_inputs, tiny_model
from seqpar.hf.vision_encode import VISION_KWARG
from seqpar.layout import padded_length
from seqpar.spawn import run_distributed

TOL = 1e-5
S = 64
ROWS = [[("text", 5), ("video", (2, 4, 4)), ("text", 10), ("image", (1, 4, 4)), ("text", 8)],
        [("text", 14), ("image", (1, 2, 4)), ("text", 6), ("video", (4, 2, 4)), ("text", 12)]]
DOCS = [[("text", 6), ("image", (1, 4, 4)), ("text", 8)], [("text", 4), ("video", (2, 2, 4)), ("text", 9)],
        [("text", 10)], [("text", 3), ("image", (1, 2, 2)), ("text", 5), ("image", (1, 2, 4)), ("text", 4)]]
MODES = {"ulysses2": (2, 2, 1), "ring2": (2, 1, 2), "usp2x2": (4, 2, 2), "ring4": (4, 1, 4)}


def _docs(specs, arch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Doc(s, arch, g) for s in specs]


def _timing(arch, media):
    if "video_grid_thw" in media and arch == "qwen2_5_vl":
        return {"second_per_grid_ts": torch.full((media["video_grid_thw"].shape[0],), SECONDS)}
    return {}


def run_case(mesh, arch: str, kind: str) -> dict:
    docs = _docs(ROWS if kind == "video" else DOCS, arch)
    ref = tiny_model(arch, seed=0).train()
    if kind == "video":
        want, ref_grads = reference(ref, [docs], arch, S)
        ids, shift = rows_batch(docs, S)
        extra = {}
    else:
        want, ref_grads = reference(ref, [[d] for d in docs], arch)
        ids, shift, cu = packed_batch(docs, padded_length(sum(d.ids.numel() for d in docs), mesh))
        extra = {"cu_seqlens": cu}
    media = media_kwargs(docs)
    model = apply_sequence_parallel(tiny_model(arch, seed=0).train(), mesh)
    kw = sp_vlm_inputs(model, mesh, ids, **media, **_timing(arch, media), **extra)
    logits = model(**kw).logits
    share = L.sft_loss(logits, seqpar.shard(shift, mesh, 1), torch.tensor(int((shift != -100).sum())))
    share.backward()
    got = float(L.global_loss(share, mesh))
    L.sum_gradients(model.parameters(), mesh)
    gs = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    err = {k: float((gs[k].double() - ref_grads[k].double()).abs().max()) for k in gs}
    worst = max(err, key=err.get)
    return {"loss": abs(got - want), "grad": err[worst], "worst": worst, "patches": kw[VISION_KWARG].encoded_patches,
            "media_patches": sum(int(g.prod(-1).sum()) for k, g in media.items() if k.endswith("grid_thw"))}


def world_cases(cases):
    meshes, out = {}, []
    for mode, arch, kind in cases:
        if mode not in meshes:
            sp, u, r = MODES[mode]
            meshes[mode] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        out.append(((mode, arch, kind), run_case(meshes[mode], arch, kind)))
    return out


def _check(per_rank):
    bad = [(r, key, res) for r, results in enumerate(per_rank) for key, res in results
           if not (res["loss"] <= TOL and res["grad"] <= TOL)]
    assert not bad, "SP != reference:\n" + "\n".join(map(str, bad))
    for i in range(len(per_rank[0])):  # every image / video once in the group (a blank one on idle ranks)
        media = per_rank[0][i][1]["media_patches"]
        encoded = [results[i][1]["patches"] for results in per_rank]
        assert media <= sum(encoded) <= media + 4 * len(encoded), (per_rank[0][i][0], encoded, media)


CASES_W2 = [("ulysses2", "qwen2_5_vl", "video"), ("ring2", "qwen3_vl", "video"),
            ("ring2", "qwen2_5_vl", "packed"), ("ulysses2", "qwen3_vl", "packed")]


def test_videos_and_packed_rows_world2():
    """Videos (both archs, both modes across them) and packed conversations with images and a video."""
    _check(run_distributed(world_cases, 2, CASES_W2, timeout=500))


@pytest.mark.slow
def test_videos_and_packed_rows_world4():
    cases = [(m, a, k) for m in ("usp2x2", "ring4") for a in ("qwen2_5_vl", "qwen3_vl") for k in ("video", "packed")]
    _check(run_distributed(world_cases, 4, cases, timeout=900))


def test_video_layout_refusals():
    """Placeholders that do not match the media are refused before any collective, naming the layout."""
    mesh = seqpar.init_mesh(1)
    for arch in ("qwen2_5_vl", "qwen3_vl"):
        docs = _docs(ROWS, arch)
        ids, _ = rows_batch(docs, S)
        media = media_kwargs(docs)
        model = apply_sequence_parallel(tiny_model(arch, seed=0), mesh)
        with pytest.raises(SeqParError, match="video tokens but video_grid_thw"):
            sp_vlm_inputs(model, mesh, ids, pixel_values=media["pixel_values"], image_grid_thw=media["image_grid_thw"])
        split = ids.clone()
        first = int((ids[0] == VIDEO).nonzero()[1])
        split[0, first] = 5  # one video run cut in two
        split[0, 40] = VIDEO
        with pytest.raises(SeqParError, match="runs of video tokens|video tokens but"):
            sp_vlm_inputs(model, mesh, split, **media)
    with pytest.raises(SeqParError, match="one value per video"):
        sp_vlm_inputs(model, mesh, ids, **media, second_per_grid_ts=torch.ones(5))
