"""Vision-language models (Qwen2.5-VL, Qwen3-VL) under SP: seqpar.hf.vision.sp_vlm_inputs + the SP model.

The SP side (full batch -> sp_vlm_inputs -> model(**kw) -> seqpar.loss.sft_loss on the shifted labels'
shard -> gradients summed over the SP ranks) is compared with an independent single-process reference:
the unmodified HF model on the full batch (its own vision tower, placeholder merge and multimodal RoPE
ids), with a hand-written shift + CE in fp64. Compared: loss, EVERY parameter gradient (vision tower,
merger, Qwen3-VL's deepstack mergers, text decoder, head) and the logits of every position.
Tolerance: fp32, 1e-5 absolute on loss and gradients, 2e-5 on logits.

Batch: B=2 rows of 48 tokens, three images of different sizes (6, 2 and 4 merged tokens); every mesh tested
has an image whose tokens are split between two ranks (asserted). Each image is encoded on exactly one rank.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar import loss as L
from seqpar.errors import SeqParError
from seqpar.hf import apply_sequence_parallel, sp_vlm_inputs, tiny_model
from seqpar.hf.vision import assign_images
from seqpar.layout import local_positions
from seqpar.spawn import run_distributed

LOSS_TOL = 1e-5
GRAD_TOL = 1e-5
LOGIT_TOL = 2e-5
S = 48
IMG, VIDEO, VS, VE = 160, 161, 162, 163  # tiny VLMs: the ids right past the text vocabulary (160)
GRIDS = [(1, 4, 6), (1, 2, 4), (1, 4, 4)]  # merged tokens 6, 2, 4 (2x2 merge); patches 24, 8, 16
# (row, first image token): image 0 spans 21..26 (seams at 24 for 2 and 4 ranks, zigzag chunks of 12 / 6),
# image 1 spans 35..36 (zigzag seam at 36 for a ring of 2), image 2 spans 14..17 (seam at 16 for 3 ranks).
PLACES = [(0, 21), (0, 35), (1, 14)]


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 140, (2, S), generator=g)
    for (row, start), (t, h, w) in zip(PLACES, GRIDS):
        n = t * h * w // 4
        ids[row, start - 1], ids[row, start: start + n], ids[row, start + n] = VS, IMG, VE
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    labels = ids.clone()
    labels[ids == IMG] = -100
    labels[:, :3] = -100
    shift = torch.full_like(labels, -100)
    shift[:, :-1] = labels[:, 1:]
    return ids, pixels, grid, shift


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def _model(arch: str, seed: int):
    """arch "frozen:<arch>": the vision tower frozen (a common recipe); then no rank runs the gather's backward."""
    model = tiny_model(arch.removeprefix("frozen:"), seed=seed).train()
    if arch.startswith("frozen:"):
        model.model.visual.requires_grad_(False)
    return model


def _reference(arch: str, seed: int):
    ids, pixels, grid, shift = _batch(seed)
    ref = _model(arch, seed)
    logits = ref(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMG).int()).logits
    keep = shift != -100
    lp = torch.log_softmax(logits.double(), -1)[keep].gather(1, shift[keep][:, None])
    loss = -lp.sum() / keep.sum()
    loss.backward()
    return float(loss), logits.detach(), _grads(ref)


def _straddles(mesh) -> bool:
    """Some image has tokens on two SP ranks."""
    owner = torch.empty(S, dtype=torch.long)
    for r in range(mesh.sp_size):
        owner[local_positions(S, mesh, r)] = r
    for (_row, start), (t, h, w) in zip(PLACES, GRIDS):
        if len(set(owner[start: start + t * h * w // 4].tolist())) > 1:
            return True
    return False


def mine_of(mesh) -> list[int]:
    return [i for i, o in enumerate(assign_images([t * h * w for t, h, w in GRIDS], mesh.sp_size)) if o == mesh.sp_rank]


def run_case(mesh, arch: str, seed: int = 0) -> dict:
    want, ref_logits, ref_grads = _reference(arch, seed)
    ids, pixels, grid, shift = _batch(seed)
    model = apply_sequence_parallel(_model(arch, seed), mesh)
    patches = []
    model.model.visual.register_forward_hook(lambda m, args, out: patches.append(int(args[0].shape[0])))
    kw = sp_vlm_inputs(model, mesh, ids, pixel_values=pixels, image_grid_thw=grid)
    logits = model(**kw).logits
    num = int((shift != -100).sum())  # one dp group: every SP rank holds the whole batch
    share = L.sft_loss(logits, seqpar.shard(shift, mesh, 1), torch.tensor(num))
    share.backward()
    got = float(L.global_loss(share, mesh))
    local_vision = float(sum(p.grad.abs().sum() for p in model.model.visual.parameters() if p.grad is not None))
    L.sum_gradients(model.parameters(), mesh)
    full = seqpar.unshard(logits.detach(), mesh, 1)
    gs = _grads(model)
    assert gs.keys() == ref_grads.keys()
    mine = mine_of(mesh)
    return {
        "loss": abs(got - want),
        "grad": max(float((gs[k].double() - ref_grads[k].double()).abs().max()) for k in gs),
        "worst": max(gs, key=lambda k: float((gs[k].double() - ref_grads[k].double()).abs().max())),
        "logits": float((full - ref_logits).abs().max()),
        "vision_grad": local_vision,  # before the SP sum: only owners of images have one
        "patches": sum(patches), "own_patches": sum(GRIDS[i][0] * GRIDS[i][1] * GRIDS[i][2] for i in mine),
        "straddles": _straddles(mesh),
    }


MODES = {"ulysses2": (2, 2, 1), "ring2": (2, 1, 2), "ulysses4": (4, 4, 1), "usp2x2": (4, 2, 2), "ring4": (4, 1, 4),
         "ulysses3": (3, 3, 1)}


def world_cases(cases):
    meshes, out = {}, []
    for mode, arch in cases:
        if mode not in meshes:
            sp, u, r = MODES[mode]
            meshes[mode] = seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r)
        out.append(((mode, arch), run_case(meshes[mode], arch)))
    return out


def _assert_results(per_rank):
    total = sum(t * h * w for t, h, w in GRIDS)
    bad = []
    for rank, results in enumerate(per_rank):
        for key, r in results:
            assert r["straddles"], f"{key}: no image is split between ranks"
            assert r["patches"] == r["own_patches"], (key, r)  # this rank encoded only its own images
            assert (r["vision_grad"] > 0) == (r["own_patches"] > 0 and not key[1].startswith("frozen:")), (key, r)
            if not (r["loss"] <= LOSS_TOL and r["grad"] <= GRAD_TOL and r["logits"] <= LOGIT_TOL):
                bad.append((rank, key, r))
    for i in range(len(per_rank[0])):  # every image once in the group
        assert sum(results[i][1]["patches"] for results in per_rank) == total
    assert not bad, "SP != no-SP:\n" + "\n".join(map(str, bad))


CASES_W2 = [("ulysses2", "qwen2_5_vl"), ("ring2", "qwen2_5_vl"), ("ulysses2", "qwen3_vl"), ("ring2", "qwen3_vl")]
# 4 ranks, 3 images: one rank encodes nothing but still joins the gather's backward (or, frozen, nobody does).
CASES_W4 = [("usp2x2", "qwen2_5_vl"), ("usp2x2", "qwen3_vl"), ("ulysses4", "qwen3_vl"), ("ring4", "qwen2_5_vl"),
            ("usp2x2", "frozen:qwen3_vl")]


def test_vlm_world2_fast():
    """Qwen2.5-VL and Qwen3-VL under Ulysses 2 and ring 2 (zigzag), an image across the seam."""
    _assert_results(run_distributed(world_cases, 2, CASES_W2, timeout=400))


@pytest.mark.slow
def test_vlm_world4():
    _assert_results(run_distributed(world_cases, 4, CASES_W4, timeout=600))


@pytest.mark.slow
def test_vlm_world3_odd():
    _assert_results(run_distributed(world_cases, 3, [("ulysses3", "qwen2_5_vl"), ("ulysses3", "qwen3_vl")],
                                    timeout=600))


def test_assign_images_balanced_and_deterministic():
    assert assign_images([24, 8, 16], 2) == [0, 1, 1]  # 24 | 8 + 16
    assert assign_images([5, 5, 5, 5], 3) == [0, 1, 2, 0]
    assert assign_images([3], 4) == [0]


def _sp1_model(arch="qwen2_5_vl"):
    return apply_sequence_parallel(tiny_model(arch, seed=0), seqpar.init_mesh(1))


def test_sp1_in_process_equals_reference():
    """SP size 1 (no process group): the same path, the same numbers as the unmodified model."""
    want, ref_logits, ref_grads = _reference("qwen3_vl", 0)
    ids, pixels, grid, shift = _batch(0)
    model = _sp1_model("qwen3_vl").train()
    logits = model(**sp_vlm_inputs(model, seqpar.init_mesh(1), ids, pixel_values=pixels, image_grid_thw=grid)).logits
    loss = L.sft_loss(logits, shift, torch.tensor(int((shift != -100).sum())))
    loss.backward()
    assert abs(float(loss) - want) <= LOSS_TOL and float((logits - ref_logits).abs().max()) <= LOGIT_TOL
    gs = _grads(model)
    assert max(float((gs[k] - ref_grads[k]).abs().max()) for k in gs) <= GRAD_TOL


def test_refusals():
    ids, pixels, grid, _ = _batch(0)
    model = _sp1_model()
    mesh = seqpar.init_mesh(1)
    with pytest.raises(SeqParError, match="sp_vlm_inputs"):
        model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, position_ids=torch.arange(S)[None])
    with pytest.raises(SeqParError, match=r"position_ids \[4, B, S_local\]"):
        model(input_ids=ids, position_ids=torch.arange(S).expand(3, 2, S))
    with pytest.raises(SeqParError, match="image tokens but image_grid_thw"):
        sp_vlm_inputs(model, mesh, ids, pixel_values=pixels[:16], image_grid_thw=grid[:2])
    video = ids.clone()
    video[0, 5] = VIDEO
    with pytest.raises(SeqParError, match="1 video tokens but video_grid_thw describes 0"):
        sp_vlm_inputs(model, mesh, video, pixel_values=pixels, image_grid_thw=grid)
    with pytest.raises(SeqParError, match="apply_sequence_parallel"):
        sp_vlm_inputs(tiny_model("qwen2_5_vl"), mesh, ids, pixel_values=pixels, image_grid_thw=grid)
    with pytest.raises(SeqParError, match="labels="):
        model(**sp_vlm_inputs(model, mesh, ids, pixel_values=pixels, image_grid_thw=grid), labels=ids)


def test_other_multimodal_models_refused():
    from types import SimpleNamespace

    from seqpar.hf.vision import check_vlm

    with pytest.raises(SeqParError, match="'llava' is not supported under SP"):
        check_vlm(SimpleNamespace(model_type="llava", text_config=object(), vision_config=object()))


def test_remove_sequence_parallel_restores_the_plain_model():
    from seqpar.hf import remove_sequence_parallel

    _, ref_logits, _ = _reference("qwen2_5_vl", 0)
    ids, pixels, grid, _ = _batch(0)
    model = remove_sequence_parallel(_sp1_model("qwen2_5_vl"))
    out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMG).int())
    assert float((out.logits - ref_logits).abs().max()) == 0.0  # pixel_values accepted again, same numbers
