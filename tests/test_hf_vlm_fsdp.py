"""FSDP2 with vision-language models under SP: the vision tower's sharded parameters are gathered identically on
every rank, also on ranks that own no image and in micro-batches without any (seqpar.hf.vision_encode: a rank
without media encodes a blank image; seqpar.memory.sharding: one FSDP2 unit per vision block and decoder layer,
or the tower in the root unit with vision="root").

Each dp group trains its own micro-batches (grad-accum 2): one with a single image (so one SP rank owns none),
one with three images over two rows (several per row), one text-only. The loss shares are scaled by dp x sp
(FSDP2 averages gradients), exactly as `seqpar train` does. Reference: the unmodified model on one process, every
dp group's micro-batches, loss = global supervised-token mean. Compared: the loss and every parameter gradient
(full tensors gathered from the shards). Tolerance: fp32, 1e-5 absolute.
"""

from __future__ import annotations

import pytest
import torch
from vlm_cases import Doc, media_kwargs, reference, rows_batch

import seqpar
from seqpar import loss as L
from seqpar.hf import apply_sequence_parallel, sp_vlm_inputs, tiny_model
from seqpar.hf.vision_encode import VISION_KWARG
from seqpar.memory.sharding import shard_over_world
from seqpar.spawn import run_distributed

TOL = 1e-5
S = 48
ONE_IMAGE = [[("text", 20), ("image", (1, 4, 4)), ("text", 10)], [("text", 30)]]
THREE_IMAGES = [[("text", 4), ("image", (1, 4, 6)), ("text", 6), ("image", (1, 2, 2)), ("text", 5)],
                [("text", 9), ("image", (1, 2, 4)), ("text", 16)]]
TEXT_ONLY = [[("text", 40)], [("text", 25)]]
# per dp group, its micro-batches (each a list of rows)
PLAN = {1: [[ONE_IMAGE, THREE_IMAGES]], 2: [[ONE_IMAGE, TEXT_ONLY], [THREE_IMAGES, ONE_IMAGE]]}


def _micro(plan, arch):
    g = torch.Generator().manual_seed(0)
    return [[[Doc(row, arch, g) for row in micro] for micro in group] for group in plan]


def run_fsdp(sp: int, arch: str, vision: str) -> dict:
    world = torch.distributed.get_world_size()
    mesh = seqpar.init_mesh(sp, ulysses_degree=1 if arch == "qwen3_vl" else sp, ring_degree=sp if arch == "qwen3_vl"
                            else 1)
    groups = _micro(PLAN[world // sp], arch)
    want, ref_grads = reference(tiny_model(arch, seed=0).train(), [m for grp in groups for m in grp], arch, S)
    total = sum(int((d.shift() != -100).sum()) for grp in groups for m in grp for d in m)
    model = apply_sequence_parallel(tiny_model(arch, seed=0).train(), mesh)
    shard_over_world(model, "cpu", world, vision=vision)
    got, patches = 0.0, []
    for docs in groups[mesh.dp_rank]:
        ids, shift = rows_batch(docs, S)
        kw = sp_vlm_inputs(model, mesh, ids, **media_kwargs(docs))
        share = L.sft_loss(model(**kw).logits, seqpar.shard(shift, mesh, 1), torch.tensor(total))
        (share * L.gradient_reduction_factor(mesh)).backward()
        got += float(L.global_loss(share, mesh))
        patches.append(kw[VISION_KWARG].encoded_patches)
    gs = {n: p.grad.full_tensor() if p.grad is not None else torch.zeros_like(p.full_tensor())
          for n, p in model.named_parameters()}
    err = {k: float((gs[k].double() - ref_grads[k].double()).abs().max()) for k in gs}
    worst = max(err, key=err.get)
    return {"loss": abs(got - want), "grad": err[worst], "worst": worst, "patches": patches,
            "vision_units": sum(type(m).__name__.startswith("FSDP") and type(m).__name__.endswith("VisionBlock")
                                for m in model.modules())}


def world_cases(cases):
    return [(c, run_fsdp(*c)) for c in cases]


def _check(per_rank, blocks):
    for results in per_rank:
        for key, r in results:
            assert r["loss"] <= TOL and r["grad"] <= TOL, (key, r)
            assert r["vision_units"] == (blocks if key[2] == "blocks" else 0), (key, r)


def test_fsdp_vlm_sp2():
    """SP=2 (dp 1) x FSDP2 over both ranks: one micro-batch with one image (rank 1 owns none: blank image),
    one with three; vision blocks as units (Qwen2.5-VL, Ulysses) and the tower in the root unit (Qwen3-VL, ring)."""
    res = run_distributed(world_cases, 2, [(2, "qwen2_5_vl", "blocks"), (2, "qwen3_vl", "root")], timeout=500)
    _check(res, 2)
    assert [res[0][0][1]["patches"][0], res[1][0][1]["patches"][0]] in ([16, 4], [4, 16])  # owner + blank image


@pytest.mark.slow
def test_fsdp_vlm_dp2_sp2():
    """dp 2 x SP 2 over 4 ranks: the dp groups' micro-batches differ (one has a text-only micro-batch)."""
    _check(run_distributed(world_cases, 4, [(2, "qwen2_5_vl", "blocks"), (2, "qwen3_vl", "blocks"),
                                            (2, "qwen3_vl", "root")], timeout=900), 2)
