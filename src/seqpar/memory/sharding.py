"""FSDP2 over all dp x sp ranks: one `fully_shard` per decoder layer (and per vision block of a vision-language
model), then the root.

SP ranks hold the same parameters, so sharding over the whole world equals sharding over dp. Used by
`seqpar train` (with its precision / offload policies) and by the Trainer drop-ins for a frozen DPO
reference model under FSDP2. Vision blocks as their own units keep at most one block's weights gathered while
the tower runs; every rank then runs the tower in every forward (seqpar.hf.vision_encode: a blank image where
a rank owns none), so their gathers always match. vision="root" leaves the tower in the root unit instead:
gathered with the embeddings for the whole forward and backward, and only image owners run it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ..errors import SeqParError
from ..mesh import group_timeout_override
from ..unwrap import decoder_layers, vision_blocks

__all__ = ["shard_over_world"]


def shard_over_world(model: torch.nn.Module, device_type: str, world: int, timeout: timedelta | None = None,
                     vision: str = "blocks", **policies: Any) -> None:
    """Shard `model` with FSDP2 over `world` ranks (every rank holds 1/world of the parameters). The mesh's
    group times out after `timeout` (None: the default group's; seqpar.mesh.group_timeout_override says why
    that needs saying). `policies`: fully_shard keyword arguments (mp_policy, offload_policy, ...). vision:
    "blocks" (a unit per vision block) or "root" (the tower in the root unit), see the module docstring."""
    if vision not in ("blocks", "root"):
        raise SeqParError(f"vision= must be 'blocks' or 'root', got {vision!r}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fmesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_sp",),
                             backend_override={"dp_sp": group_timeout_override(timeout, world)})
    for layer in (vision_blocks(model) if vision == "blocks" else []) + decoder_layers(model):
        fully_shard(layer, mesh=fmesh, **policies)
    fully_shard(model, mesh=fmesh, **policies)
