"""The memory features compose with vision-language models under SP: layer checkpointing (the vision tower's
blocks too: transformers' GradientCheckpointingLayer), the checkpointed inputs offloaded to host memory, the fused
chunked head + loss, the tiled MLP, on the step path `seqpar train` and the drop-ins use
(seqpar.hf.prepare_model -> seqpar.data.VisionCollator -> seqpar.steps.micro_batch_loss).

Batches: rows with images and a video (B=2), and a packed row of conversations with images, a video and text only,
two micro-batches of one step. Reference: the unmodified model on one process (tests/vlm_cases.py; packed documents
each alone), loss = the step's global supervised-token mean. Compared: loss and every parameter gradient after the
SP gradient sum. Tolerance: fp32, 1e-5 absolute. Also asserted: every vision block and decoder layer is
checkpointed. The fused head runs 16 supervised tokens per chunk (several chunks per micro-batch), the MLPs in 2
tiles.
"""

from __future__ import annotations

import pytest
import torch
from vlm_cases import SECONDS, Doc, media_kwargs, reference

import seqpar
from seqpar import loss as L
from seqpar.data import VisionCollator
from seqpar.hf import tiny_model
from seqpar.hf.prepare import PrepareSpec, prepare_model
from seqpar.spawn import run_distributed
from seqpar.steps import StepSpec, micro_batch_loss
from seqpar.unwrap import vision_blocks

TOL = 1e-5
ROWS = [[("text", 5), ("video", (2, 4, 4)), ("text", 10), ("image", (1, 4, 4)), ("text", 8)],
        [("text", 14), ("image", (1, 2, 4)), ("text", 6), ("text", 12)]]
DOCS = [[("text", 6), ("image", (1, 4, 4)), ("text", 8)], [("text", 4), ("video", (2, 2, 4)), ("text", 9)],
        [("text", 10)]]


def _row(d: Doc, arch: str) -> dict:
    row = {"input_ids": d.ids.tolist(), "labels": d.labels.tolist(), **media_kwargs([d])}
    if d.videos and arch == "qwen2_5_vl":
        row["second_per_grid_ts"] = [SECONDS]
    return row


def run_case(mesh, arch: str) -> dict:
    g = torch.Generator().manual_seed(0)
    rows, docs = [Doc(s, arch, g) for s in ROWS], [Doc(s, arch, g) for s in DOCS]
    want, ref_grads = reference(tiny_model(arch, seed=0).train(), [rows] + [[d] for d in docs], arch)
    model = tiny_model(arch, seed=0).train()
    spec = PrepareSpec(fused_loss=True, loss_chunk_tokens=16, activation_checkpointing=True, offload_activations=True,
                       tiled_mlp=2)
    model = prepare_model(model, mesh, spec)
    batches = [VisionCollator(mesh, 0)([_row(d, arch) for d in rows]),
               VisionCollator(mesh, 0, packing=True)([_row(d, arch) for d in docs])]
    num = torch.tensor(sum(int(b["num_supervised_tokens"]) for b in batches))
    step = StepSpec("sft", **spec.head_kwargs())
    got = 0.0
    for b in batches:
        share, _ = micro_batch_loss(model, b, num, mesh, step)
        share.backward()
        got += float(L.global_loss(share.detach(), mesh))
    L.sum_gradients(model.parameters(), mesh)
    gs = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    err = {k: float((gs[k].double() - ref_grads[k].double()).abs().max()) for k in gs}
    worst = max(err, key=err.get)
    layers = vision_blocks(model) + [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    return {"loss": abs(got - want), "grad": err[worst], "worst": worst,
            "checkpointed": all(m.gradient_checkpointing for m in layers) and len(vision_blocks(model)) == 2}


def world_cases(cases):
    out = []
    for sp, u, r, arch in cases:
        out.append(((sp, u, r, arch), run_case(seqpar.init_mesh(sp, ulysses_degree=u, ring_degree=r), arch)))
    return out


def _check(per_rank):
    for results in per_rank:
        for key, r in results:
            assert r["checkpointed"], (key, r)
            assert r["loss"] <= TOL and r["grad"] <= TOL, (key, r)


def test_memory_features_with_vlm_world2():
    """Qwen2.5-VL at Ulysses 2 and Qwen3-VL at ring 2, every memory feature on."""
    _check(run_distributed(world_cases, 2, [(2, 2, 1, "qwen2_5_vl"), (2, 1, 2, "qwen3_vl")], timeout=500))


@pytest.mark.slow
def test_memory_features_with_vlm_usp():
    _check(run_distributed(world_cases, 4, [(4, 2, 2, "qwen2_5_vl"), (4, 2, 2, "qwen3_vl")], timeout=900))
