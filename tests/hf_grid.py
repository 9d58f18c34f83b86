"""Whole HF models against the unmodified model on a grid of SP modes (seqpar.hf.equivalence.compare), shared by
the attention-variant and hybrid-family tests. Build each model ONCE in the main thread (fixed seed) and hand it in:
ranks that are threads deep-copy it (torch's global RNG is shared by threads)."""

from __future__ import annotations

import copy

import seqpar
from seqpar.hf.equivalence import compare


def run_grid(models: dict, modes: list[tuple[int, int]], rows: list) -> list:
    """On every rank: ((name, ulysses, ring, packing), errors) for each model, mode and batch kind."""
    out = []
    for u, r in modes:
        mesh = seqpar.init_mesh(u * r, ulysses_degree=u, ring_degree=r)
        for name, base in models.items():
            for packing in (False, True):
                errs = compare(lambda m=base: copy.deepcopy(m), rows, mesh, packing=packing)
                out.append(((name, u, r, packing), errs))
    return out


def assert_within(results: list, tol: float) -> dict:
    """Every rank's loss, grad, logits and count errors within `tol`; returns the worst of each."""
    bad = [(k, e) for rank in results for k, e in rank if max(e["loss"], e["grad"], e["logits"], e["count"]) > tol]
    assert not bad, bad
    return {k: max(e[k] for rank in results for _, e in rank) for k in ("loss", "grad", "logits")}


def mixer_world(model, u: int, r: int, keep=lambda name: True, relative: bool = True):
    """Inside a 2-rank world: the model's first recurrent mixer under SP (Ulysses u x ring r) vs its own forward on the
    whole sequence (B = 2, 40 tokens, float64): (max output error, {parameter: max gradient error}) for the parameters
    `keep` accepts, gradients summed over the ranks; relative to the reference gradient's max, or absolute."""
    import torch

    from seqpar.hf.recurrent_layers import find_recurrent, recurrent_forward

    mesh = seqpar.init_mesh(2, ulysses_degree=u, ring_degree=r)
    layer = copy.deepcopy(find_recurrent(model)[0][0])
    ref_layer = copy.deepcopy(layer)
    x, w = (torch.randn(2, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(i),
                        dtype=torch.float64) for i in (0, 1))
    ref = ref_layer(x)
    (ref * w).sum().backward()
    out = recurrent_forward(layer)(layer, seqpar.shard(x, mesh, 1), None, ((), ()), mesh)
    (out * seqpar.shard(w, mesh, 1)).sum().backward()
    return float((seqpar.unshard(out.detach(), mesh, 1) - ref.detach()).abs().max()), \
        summed_grad_errors(ref_layer, layer, keep, relative)


def summed_grad_errors(ref_layer, layer, keep=lambda name: True, relative: bool = True) -> dict[str, float]:
    """{parameter: max |reference gradient - SP gradient summed over the ranks|} (divided by the reference's max when
    `relative`) for the parameters `keep` accepts."""
    import torch

    errs = {}
    for (name, p), (_, q) in zip(ref_layer.named_parameters(), layer.named_parameters()):
        if keep(name):
            g = q.grad.clone()
            torch.distributed.all_reduce(g)
            err = (p.grad - g).abs().max()
            errs[name] = float(err / p.grad.abs().max() if relative else err)
    return errs
