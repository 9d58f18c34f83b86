"""FSDP2 over all dp x sp ranks: one `fully_shard` per decoder layer, then the root.

SP ranks hold the same parameters, so sharding over the whole world equals sharding over dp. Used by
`seqpar train` (with its precision / offload policies) and by the Trainer drop-ins for a frozen DPO
reference model under FSDP2.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ..mesh import group_timeout_override
from ..unwrap import decoder_layers

__all__ = ["shard_over_world"]


def shard_over_world(model: torch.nn.Module, device_type: str, world: int, timeout: timedelta | None = None,
                     **policies: Any) -> None:
    """Shard `model` with FSDP2 over `world` ranks (every rank holds 1/world of the parameters). The mesh's
    group times out after `timeout` (None: the default group's; seqpar.mesh.group_timeout_override says why
    that needs saying). `policies`: fully_shard keyword arguments (mp_policy, offload_policy, ...)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fmesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_sp",),
                             backend_override={"dp_sp": group_timeout_override(timeout, world)})
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=fmesh, **policies)
    fully_shard(model, mesh=fmesh, **policies)
