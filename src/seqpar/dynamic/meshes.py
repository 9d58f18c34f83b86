"""The meshes of length-aware SP: one per degree, created once at start, and the group view a micro-batch runs on.

`torch.distributed.new_group` is collective over the whole world, so every group a step may use exists before
the first step: for each degree d the mesh of `init_mesh(d)` (W / d groups of d consecutive ranks, split into
ulysses x ring as given). A micro-batch of degree d runs on this rank's *group view* of that mesh: the same
SP / ring / ulysses groups, dp = 1 and no dp group, so nothing in the forward or the loss reduces over ranks
outside the group (the step sums over the world itself). The degree-1 mesh spans the world in its dp dimension:
the step's world sums (loss denominators, gradients, metrics) run on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

from ..mesh import SequenceParallelMesh, init_mesh

__all__ = ["DegreeMeshes", "init_degree_meshes", "group_view"]


def group_view(mesh: SequenceParallelMesh) -> SequenceParallelMesh:
    """`mesh` restricted to this rank's SP group: dp 1, no dp group (the same SP groups and byte counters)."""
    return replace(mesh, dp_size=1, dp_rank=0, dp_group=None)


@dataclass
class DegreeMeshes:
    """Every degree's mesh (dp = world / d) and this rank's group view of each."""

    meshes: dict[int, SequenceParallelMesh]
    views: dict[int, SequenceParallelMesh]
    world: int
    rank: int

    @property
    def degrees(self) -> list[int]:
        return sorted(self.meshes)

    @property
    def top(self) -> int:
        return max(self.meshes)

    @property
    def world_mesh(self) -> SequenceParallelMesh:
        """The degree-1 mesh: dp spans the world (sums over every rank)."""
        return self.meshes[1]

    def view(self, d: int) -> SequenceParallelMesh:
        return self.views[d]


def init_degree_meshes(degrees: dict[int, tuple[int, int]], world: int, rank: int, *, layout: str = "zigzag",
                       node_size: int | None = None, timeout: timedelta | None = None,
                       state_passing: str = "chain") -> DegreeMeshes:
    """The mesh of every degree in `degrees` ({d: (ulysses, ring)}), in ascending order on every rank (each
    creation is collective over the world)."""
    meshes = {}
    for d in sorted(set(degrees) | {1}):
        u, r = degrees.get(d, (1, 1))
        meshes[d] = init_mesh(d, ulysses_degree=u, ring_degree=r, layout=layout, node_size=node_size,
                              timeout=timeout, state_passing=state_passing)
    return DegreeMeshes(meshes, {d: group_view(m) for d, m in meshes.items()}, world, rank)
