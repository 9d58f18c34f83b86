"""Gradient checks for `seqpar verify`: the step-1 gradient dump and the SP-vs-reference comparisons.

Loss curves alone cannot see a constant gradient-scale error (AdamW without clipping is invariant to
it), so verify also compares, per step, the global pre-clip gradient norm that every metrics row
logs, and, element by element, the full pre-clip gradient of step 1, which `train()` writes when
GRAD_DUMP_ENV names a file (internal; verify sets it for both runs).

GRAD_SCALE_FAULT_ENV is a test-only fault: in multi-rank runs (the SP side of verify, never its
one-process reference) every loss share is multiplied by it, i.e. the gradient-sum normalisation
is broken by that factor. Tests use it to show that verify FAILS on a scale error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["GRAD_DUMP_ENV", "GRAD_SCALE_FAULT_ENV", "fault_grad_scale", "maybe_dump_grads", "grad_norm_errors",
           "grad_dump_errors"]

GRAD_DUMP_ENV = "SEQPAR_GRAD_DUMP"
GRAD_SCALE_FAULT_ENV = "SEQPAR_FAULT_GRAD_SCALE"


def fault_grad_scale(world: int) -> float:
    """The test-only gradient-scale fault (1.0 unless GRAD_SCALE_FAULT_ENV is set and world > 1)."""
    v = os.environ.get(GRAD_SCALE_FAULT_ENV)
    return float(v) if v and world > 1 else 1.0


def full_grad(p: torch.Tensor) -> torch.Tensor:
    """The full fp32 CPU gradient of p (a collective for FSDP2 DTensor gradients: every rank calls it)."""
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    if hasattr(g, "full_tensor"):
        g = g.full_tensor()
    return g.detach().float().cpu()


def maybe_dump_grads(model: torch.nn.Module, params: Sequence[torch.Tensor], step: int, rank: int) -> None:
    """At step 0, when GRAD_DUMP_ENV is set: write {name: full gradient} (rank 0) to that path.

    params: the optimizer's parameters, in the order of model's trainable parameters (they may be
    fp32 master copies of them). Call it after the gradients are summed over dp x sp, before clipping.
    """
    path = os.environ.get(GRAD_DUMP_ENV)
    if not path or step != 0:
        return
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if len(names) != len(params):
        raise RuntimeError(f"{len(names)} trainable parameters but {len(params)} optimizer parameters")
    grads = {n: full_grad(p) for n, p in zip(names, params)}
    if rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(grads, path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def grad_norm_errors(sp_norms: Sequence[float], ref_norms: Sequence[float]) -> list[float]:
    """Per step |gn_SP - gn_ref| / max(gn_ref, tiny)."""
    return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(sp_norms, ref_norms)]


def grad_dump_errors(sp: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max |g_SP - g_ref| over every element, that / max |g_ref|) of two step-1 gradient dumps."""
    if sorted(sp) != sorted(ref):
        only = sorted(set(sp) ^ set(ref))[:4]
        raise ValueError(f"the gradient dumps name different parameters (e.g. {only})")
    dmax = max(float((sp[k] - ref[k]).abs().max()) if sp[k].numel() else 0.0 for k in ref)
    gmax = max(float(ref[k].abs().max()) if ref[k].numel() else 0.0 for k in ref)
    return dmax, dmax / max(gmax, 1e-30)
