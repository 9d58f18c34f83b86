"""Tiny VLM batches with images and videos, and their single-process references (tests of seqpar.hf.vision).

A document is a list of segments: ("text", n) random ids, ("image", (t, h, w)) or ("video", (t, h, w)) patch
grids. Each image / video becomes vision start + one token per merged patch (2x2 merge) + vision end, as the
processors expand them; Qwen3-VL videos become one such run per temporal patch, each after a 2-token
timestamp (its processor's `<t seconds>` text). Pixels are random (96 values per patch: 3 channels x 2 frames x
4 x 4 pixels). The reference is the unmodified HF model (its own vision tower, placeholder merge and
multimodal RoPE), each row (or each document of a packed row, on its own) with a hand-written shift + CE in
fp64, normalised by the batch's supervised-token count.
"""

from __future__ import annotations

import torch

IMG, VIDEO, VS, VE = 160, 161, 162, 163  # tiny VLMs: the ids right past the text vocabulary (160)
PATCH_DIM = 3 * 2 * 4 * 4
SECONDS = 0.5  # Qwen2.5-VL: seconds per temporal patch of every test video (tokens_per_second 2: RoPE step 1)


class Doc:
    """One document's ids, labels (image / video / timestamp tokens unsupervised) and media."""

    def __init__(self, segments: list, arch: str, g: torch.Generator) -> None:
        ids: list[int] = []
        sup: list[bool] = []
        self.images, self.videos = [], []  # (grid, pixels)
        for kind, spec in segments:
            if kind == "text":
                ids += torch.randint(3, 140, (spec,), generator=g).tolist()
                sup += [True] * spec
                continue
            t, h, w = spec
            pixels = torch.randn(t * h * w, PATCH_DIM, generator=g)
            (self.images if kind == "image" else self.videos).append((spec, pixels))
            tok = IMG if kind == "image" else VIDEO
            frames = t if (kind == "video" and arch == "qwen3_vl") else 1
            per = t * h * w // 4 // frames
            for _ in range(frames):
                if kind == "video" and arch == "qwen3_vl":
                    ids += torch.randint(3, 140, (2,), generator=g).tolist()  # the frame's timestamp text
                    sup += [False, False]
                ids += [VS] + [tok] * per + [VE]
                sup += [False] * (per + 2)
        self.ids = torch.tensor(ids)
        self.labels = torch.where(torch.tensor(sup), self.ids, torch.full_like(self.ids, -100))
        self.labels[:2] = -100

    def shift(self) -> torch.Tensor:
        out = torch.full_like(self.labels, -100)
        out[:-1] = self.labels[1:]
        return out


def media_kwargs(docs: list[Doc]) -> dict:
    """The processor's tensors for the media of `docs`, in order (images, then videos)."""
    kw: dict = {}
    images = [m for d in docs for m in d.images]
    videos = [m for d in docs for m in d.videos]
    if images:
        kw["pixel_values"] = torch.cat([p for _, p in images])
        kw["image_grid_thw"] = torch.tensor([g for g, _ in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([p for _, p in videos])
        kw["video_grid_thw"] = torch.tensor([g for g, _ in videos])
    return kw


def rows_batch(docs: list[Doc], length: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One document per row, right-padded to `length`: (ids [B, S], shifted labels [B, S])."""
    ids = torch.full((len(docs), length), pad)
    shift = torch.full((len(docs), length), -100)
    for r, d in enumerate(docs):
        ids[r, :d.ids.numel()] = d.ids
        shift[r, :d.ids.numel()] = d.shift()
    return ids, shift


def packed_batch(docs: list[Doc], length: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All documents in one row (then padding, its own last document): (ids [1, S], shift [1, S], cu_seqlens)."""
    ids = torch.cat([d.ids for d in docs])
    shift = torch.cat([d.shift() for d in docs])
    n = ids.numel()
    cu = [0]
    for d in docs:
        cu.append(cu[-1] + d.ids.numel())
    if length > n:
        cu.append(length)
    ids = torch.cat([ids, torch.full((length - n,), pad)])
    shift = torch.cat([shift, torch.full((length - n,), -100)])
    return ids[None], shift[None], torch.tensor(cu, dtype=torch.int32)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def hf_forward(model, ids: torch.Tensor, media: dict, arch: str) -> torch.Tensor:
    """The unmodified model's logits for full rows with their media."""
    kw = dict(media)
    if "video_grid_thw" in kw and arch == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.full((kw["video_grid_thw"].shape[0],), SECONDS)
    types = (ids == IMG).int() + 2 * (ids == VIDEO).int()
    return model(input_ids=ids, mm_token_type_ids=types, **kw).logits


def nll_sum(logits: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    keep = shift != -100
    return -torch.log_softmax(logits.double(), -1)[keep].gather(1, shift[keep][:, None]).sum()


def reference(model, groups: list[list[Doc]], arch: str, length: int | None = None) -> tuple[float, dict]:
    """Loss (supervised-token mean over every group) and gradients of the unmodified model; each group is one
    forward: several rows (length: their padded length), or one document alone (length None)."""
    total = sum(int((d.shift() != -100).sum()) for grp in groups for d in grp)
    loss = 0.0
    for grp in groups:
        ids, shift = rows_batch(grp, length or max(d.ids.numel() for d in grp))
        part = nll_sum(hf_forward(model, ids, media_kwargs(grp), arch), shift) / total
        part.backward()
        loss += float(part)
    return loss, grads(model)


def write_images(d, sizes: list[tuple[int, int]], seed: int = 0):
    """Random RGB PNGs d/i{k}.png of the given (height, width) sizes; returns the generator, to go on drawing."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k, (h, w) in enumerate(sizes):
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(d / f"i{k}.png")
    return rng


def sgd_step(model, loss: torch.Tensor, lr: float) -> None:
    """The reference's hand-written SGD step: backward, then p -= lr * grad for every parameter that got one."""
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for q in model.parameters():
            if q.grad is not None:
                q -= lr * q.grad
