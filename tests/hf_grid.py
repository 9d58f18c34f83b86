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
