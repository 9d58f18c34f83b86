"""The TRL GRPO drop-in's rollout share (seqpar.trl.grpo): each SP rank generates a share of the rollout rows
under its own forked RNG and the shares are all-gathered, so every rank of the group trains identical rows."""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .generation import group_source_rank, prompt_share

__all__ = ["share_rollout", "rng_states", "set_rng_states"]


def rng_states(device: torch.device) -> tuple[torch.Tensor, Any]:
    dev = None if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state()
    return torch.get_rng_state(), dev


def set_rng_states(states: tuple[torch.Tensor, Any], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:  # GPU path: untested on CPU CI
        torch.get_device_module(device.type).set_rng_state(states[1])



def share_rollout(run: Any, n: int, num_generations: int, mesh: SequenceParallelMesh,
                   device: torch.device, sharded: bool) -> Any:
    """`run(rows)` on this SP rank's share (a range) of the `n` rollout rows (whole prompt groups,
    `prompt_share`), then all-gathered.

    RNG: SP rank 0 draws a base seed and its RNG state after the draw goes to the group (TRL shuffles the rows
    next: the same permutation on every rank); each rank samples under torch.random.fork_rng seeded from
    (base, its global shard index), so its draws depend on that seed only. A sharded model: every rank runs
    one generate() (a rank without prompts decodes row 0 and drops it)."""
    unit = num_generations if n % num_generations == 0 else 1
    share = prompt_share(n // unit, mesh.sp_size, mesh.sp_rank)
    mine = range(share.start * unit, share.stop * unit)
    base = None
    if mesh.sp_rank == 0:
        base = (int(torch.randint(0, 2**62, (1,))), rng_states(device))
    base = comm.broadcast_object(base, group_source_rank(mesh), mesh.comm_device, group=mesh.sp_group)
    set_rng_states(base[1], device)
    result: Any = ([], None)
    devices = [device] if device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed((base[0] * 1_000_003 + group_source_rank(mesh) + mesh.sp_rank) % (2**63 - 1))
            if mine:
                result = run(mine)
            elif sharded:
                run(range(1))
    except Exception as e:  # travels to the group's other ranks, which would otherwise wait forever
        result = SeqParError(f"generation failed on rank {group_source_rank(mesh) + mesh.sp_rank}: "
                             f"{type(e).__name__}: {e}")
    parts = comm.all_gather_object(result, group=mesh.sp_group)
    for p in parts:
        if isinstance(p, Exception):
            raise SeqParError(str(p))
    ids = [c for p in parts for c in p[0]]
    logprobs = None if any(p[1] is None for p in parts if p[0]) else [x for p in parts for x in (p[1] or [])]
    return ids, logprobs
