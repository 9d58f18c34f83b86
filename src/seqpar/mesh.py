"""SequenceParallelMesh: dp x ring x ulysses over a torch DeviceMesh.

Rank order follows the USP paper's advice: ulysses innermost (contiguous ranks, fastest links),
then ring, then dp outermost. Global rank = dp_rank * (ring * ulysses) + ring_rank * ulysses + ulysses_rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .comm import CommStats
from .errors import SeqParError

__all__ = ["SequenceParallelMesh", "init_mesh", "auto_degrees", "divisors", "needs_full_sequence"]

LAYOUTS = ("zigzag", "contiguous")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def needs_full_sequence(model_config: Any) -> bool:
    """Whether the model has linear-attention layers (Qwen3-Next / Qwen3.5 Gated DeltaNet): their recurrence
    needs the whole sequence on one rank, so SP must be pure Ulysses (seqpar.hf.linear_attention)."""
    cfg = getattr(model_config, "text_config", None) or model_config
    return "linear_attention" in (getattr(cfg, "layer_types", None) or ())


def auto_degrees(sp_size: int, num_heads: int | None = None, num_kv_heads: int | None = None, *,
                 ulysses_only: bool = False) -> tuple[int, int]:
    """Pick (ulysses_degree, ring_degree) with ulysses * ring == sp_size.

    With head counts: the largest ulysses degree that divides sp_size, num_heads and num_kv_heads
    (no dummy heads, no KV replication), the rest ring. Without head counts: pure ring
    (ulysses=1), which is correct for every head count. ulysses_only (models with linear-attention
    layers, `needs_full_sequence`): pure Ulysses; softmax heads it does not divide get dummy heads.
    """
    if ulysses_only:
        return sp_size, 1
    if num_heads is None:
        return 1, sp_size
    kv = num_kv_heads if num_kv_heads is not None else num_heads
    best = 1
    for u in divisors(sp_size):
        if num_heads % u == 0 and kv % u == 0:
            best = u
    return best, sp_size // best


def _heads_from_config(model_config: Any) -> tuple[int, int]:
    cfg = getattr(model_config, "text_config", None) or model_config
    h = getattr(cfg, "num_attention_heads", None)
    if h is None:
        raise SeqParError("model_config has no num_attention_heads: pass num_heads= and num_kv_heads= instead")
    kv = getattr(cfg, "num_key_value_heads", None) or h
    return int(h), int(kv)


@dataclass
class SequenceParallelMesh:
    """The explicit parallel layout passed to every seqpar call (no hidden globals).

    sp_group spans ring x ulysses (one SP group = ranks that share a sequence); dp_group spans
    ranks holding the same sequence position in different SP groups. Groups are None when the
    corresponding size is 1 and no process group exists (single-process use).
    """

    dp_size: int
    ring_degree: int
    ulysses_degree: int
    dp_rank: int = 0
    ring_rank: int = 0
    ulysses_rank: int = 0
    layout: str = "zigzag"
    device_mesh: Any = None
    sp_group: Any = None
    dp_group: Any = None
    ring_group: Any = None
    ulysses_group: Any = None
    stats: CommStats = field(default_factory=CommStats)

    @property
    def sp_size(self) -> int:
        return self.ring_degree * self.ulysses_degree

    @property
    def sp_rank(self) -> int:
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.sp_size

    @property
    def comm_device(self) -> torch.device:
        """Where every tensor handed to this mesh's collectives must live (see seqpar.comm's device rule):
        the current CUDA device on a CUDA (NCCL) mesh, the CPU on a gloo mesh or without process groups."""
        dtype = getattr(self.device_mesh, "device_type", "cpu") if self.device_mesh is not None else "cpu"
        if dtype == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        if dtype == "cpu":
            return torch.device("cpu")
        module = getattr(torch, dtype, None)  # other accelerators (xpu, ...): their current device
        index = module.current_device() if hasattr(module, "current_device") else None
        return torch.device(dtype, index)

    @property
    def effective_layout(self) -> str:
        """The layout shard() uses: contiguous whenever there is no ring to balance."""
        return self.layout if self.ring_degree > 1 else "contiguous"

    def __repr__(self) -> str:
        return (
            f"SequenceParallelMesh(dp={self.dp_size}, ring={self.ring_degree}, ulysses={self.ulysses_degree}, "
            f"layout={self.effective_layout}, rank dp/ring/ulysses={self.dp_rank}/{self.ring_rank}/{self.ulysses_rank})"
        )


def _device_type() -> str:
    backend = dist.get_backend()
    if backend == "nccl" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def init_mesh(
    sp_size: int,
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    model_config: Any = None,
    layout: str = "zigzag",
    device_type: str | None = None,
) -> SequenceParallelMesh:
    """Build the dp x ring x ulysses mesh. Needs torch.distributed initialised unless world size is 1.

    dp = world_size // sp_size. ulysses_degree * ring_degree must equal sp_size; give one, both or
    neither (automatic, see `auto_degrees`; pass head counts or an HF `model_config` for the best
    choice). `layout` is the ring sequence layout: "zigzag" (causal load balance, default) or
    "contiguous". Every check runs before any process group is created.
    """
    if not isinstance(sp_size, int) or sp_size < 1:
        raise SeqParError(f"sp_size must be a positive int, got {sp_size!r}")
    if layout not in LAYOUTS:
        raise SeqParError(f"layout={layout!r} is unknown: use one of {LAYOUTS}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % sp_size != 0:
        ok = ", ".join(str(d) for d in divisors(world))
        raise SeqParError(f"sp_size={sp_size} does not divide world_size={world}: use one of {ok}")
    if model_config is not None and num_heads is None:
        num_heads, num_kv_heads = _heads_from_config(model_config)
    if num_heads is not None:
        kv = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads < 1 or kv < 1 or num_heads % kv != 0:
            raise SeqParError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={kv}")
    for name, val in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if val is not None and (not isinstance(val, int) or val < 1 or sp_size % val != 0):
            ok = ", ".join(str(d) for d in divisors(sp_size))
            raise SeqParError(f"{name}={val!r} must divide sp_size={sp_size}: use one of {ok}")
    if ulysses_degree is None and ring_degree is None:
        full = model_config is not None and needs_full_sequence(model_config)
        ulysses_degree, ring_degree = auto_degrees(sp_size, num_heads, num_kv_heads, ulysses_only=full)
    elif ulysses_degree is None:
        ulysses_degree = sp_size // ring_degree
    elif ring_degree is None:
        ring_degree = sp_size // ulysses_degree
    if ulysses_degree * ring_degree != sp_size:
        raise SeqParError(
            f"ulysses_degree={ulysses_degree} x ring_degree={ring_degree} = {ulysses_degree * ring_degree} "
            f"!= sp_size={sp_size}: choose degrees whose product is sp_size"
        )
    dp = world // sp_size
    if world == 1:
        return SequenceParallelMesh(dp_size=1, ring_degree=1, ulysses_degree=1, layout=layout)

    from torch.distributed.device_mesh import DeviceMesh

    dtype = device_type or _device_type()
    ranks = torch.arange(world).reshape(dp, ring_degree, ulysses_degree)
    dm = DeviceMesh(dtype, ranks, mesh_dim_names=("dp", "ring", "ulysses"))
    sp_mesh = dm["ring", "ulysses"]._flatten("sp")
    rank = dist.get_rank()
    return SequenceParallelMesh(
        dp_size=dp,
        ring_degree=ring_degree,
        ulysses_degree=ulysses_degree,
        dp_rank=rank // sp_size,
        ring_rank=(rank % sp_size) // ulysses_degree,
        ulysses_rank=rank % ulysses_degree,
        layout=layout,
        device_mesh=dm,
        sp_group=sp_mesh.get_group(),
        dp_group=dm.get_group("dp"),
        ring_group=dm.get_group("ring"),
        ulysses_group=dm.get_group("ulysses"),
    )
