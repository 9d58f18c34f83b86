"""SequenceParallelMesh: dp x ring x ulysses over a torch DeviceMesh.

Rank order follows the USP paper's advice: ulysses innermost (contiguous ranks, fastest links),
then ring, then dp outermost. Global rank = dp_rank * (ring * ulysses) + ring_rank * ulysses + ulysses_rank.
torchrun numbers ranks node by node, so a Ulysses group stays inside a node when its degree divides the
processes per node (LOCAL_WORLD_SIZE): the automatic degrees keep to that, explicit ones that do not get a
warning. Every process group created here gets one timeout (`timeout=`; DeviceMesh subgroups would
otherwise take torch's global default, 30 minutes, not the default group's).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .comm import CommStats
from .errors import SeqParError

__all__ = ["SequenceParallelMesh", "init_mesh", "auto_degrees", "resolve_degrees", "check_divides", "divisors",
           "RecurrentHeads", "recurrent_heads", "STATE_PASSING", "node_size_from_env", "spans_nodes_message",
           "group_timeout_override"]

LAYOUTS = ("zigzag", "contiguous")
# How ring ranks combine recurrent layers' states (seqpar.recurrent.combine): point-to-point hand-off or all-gather.
STATE_PASSING = ("chain", "scan")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class RecurrentHeads:
    """The head counts of a hybrid model's recurrent layers, which bound its Ulysses degree (the ring has no
    bound: state passing, seqpar.recurrent). kind "gated_deltanet" (Qwen3-Next / Qwen3.5): the degree divides the
    k heads; "mamba2" (Nemotron-H, Granite 4, Bamba): it divides the heads and divides or is a multiple of the
    B / C groups (seqpar.hf.mamba2)."""

    kind: str
    heads: int
    groups: int = 1

    def allows(self, ulysses: int) -> bool:
        if self.heads % ulysses != 0:
            return False
        return self.kind != "mamba2" or self.groups % ulysses == 0 or ulysses % self.groups == 0

    def degrees(self, sp_size: int) -> list[int]:
        """The Ulysses degrees dividing sp_size that these layers allow."""
        return [u for u in divisors(sp_size) if self.allows(u)]


_RECURRENT_FIELDS = (  # (kind, heads field, groups field) of the config families seqpar runs
    ("gated_deltanet", "linear_num_key_heads", None),
    ("gated_deltanet", "linear_num_heads", None),  # Kimi-Linear's KDA (the same bound: the degree divides the heads)
    ("mamba2", "mamba_num_heads", "n_groups"),  # Nemotron-H
    ("mamba2", "mamba_n_heads", "mamba_n_groups"),  # Granite 4 (GraniteMoeHybrid), Bamba, Falcon-H1
    ("mamba2", "n_mamba_heads", "mamba_ngroups"),  # Zamba2
)


def recurrent_heads(model_config: Any) -> RecurrentHeads | None:
    """The recurrent layers' head counts of a hybrid model's config (None: softmax attention only, or no
    recurrent layer in its layer_types)."""
    cfg = getattr(model_config, "text_config", None) or model_config
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or ()
    if not any(str(t) in ("linear_attention", "mamba", "hybrid") for t in types):
        return None
    for kind, heads, groups in _RECURRENT_FIELDS:
        h = getattr(cfg, heads, None)
        if isinstance(h, int) and h > 0:
            g = getattr(cfg, groups, None) if groups else 1
            return RecurrentHeads(kind, h, int(g) if isinstance(g, int) and g > 0 else 1)
    return None


def node_size_from_env(world: int) -> int:
    """Processes per node: LOCAL_WORLD_SIZE (set by torchrun) when it divides the world size, else the world
    (one node, or nodes of unequal size, where no placement can be promised)."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        return world
    return n if 0 < n <= world and world % n == 0 else world


def auto_degrees(sp_size: int, num_heads: int | None = None, num_kv_heads: int | None = None, *,
                 recurrent: RecurrentHeads | None = None, node_size: int | None = None) -> tuple[int, int]:
    """Pick (ulysses_degree, ring_degree) with ulysses * ring == sp_size.

    With head counts: the largest ulysses degree that divides sp_size, num_heads, num_kv_heads and
    node_size (no dummy heads, no KV replication, and, since ranks are numbered node by node, no Ulysses
    group across nodes: its all-to-alls stay on the fast intra-node links) and that a hybrid model's recurrent
    layers allow (`recurrent`: their heads; they pass state around the ring for the rest), the rest ring.
    Without head counts: pure ring (ulysses=1), which is correct for every head count and layer kind.
    """
    if num_heads is None:
        return 1, sp_size
    kv = num_kv_heads if num_kv_heads is not None else num_heads
    best = 1
    for u in divisors(sp_size):
        if (num_heads % u == 0 and kv % u == 0 and (node_size is None or node_size % u == 0)
                and (recurrent is None or recurrent.allows(u))):
            best = u
    return best, sp_size // best


def spans_nodes_message(ulysses_degree: int, ring_degree: int, node_size: int) -> str | None:
    """Why a Ulysses degree that does not divide the processes per node is slow, and the fix (None: it fits)."""
    if ulysses_degree == 1 or node_size % ulysses_degree == 0:
        return None
    sp = ulysses_degree * ring_degree
    u = max(d for d in divisors(sp) if node_size % d == 0)
    why = (f"ulysses_degree={ulysses_degree} does not divide the {node_size} processes per node (LOCAL_WORLD_SIZE): "
           f"some Ulysses groups span nodes and run their all-to-alls over the inter-node network (correct, but "
           f"slow); ")
    return why + (f"set ulysses_degree={u} and ring_degree={sp // u} (ring traffic crosses nodes well), or leave "
                  f"both unset for the automatic choice")


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
    state_passing: str = "chain"  # how the ring combines recurrent states (STATE_PASSING; seqpar.recurrent)
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
    """The device the default group communicates on: the one it declares (`comm_device_type`: seqpar.threaded's
    worlds) or was bound to (init_process_group(device_id=)), else CUDA for NCCL, else the CPU."""
    pg = dist.distributed_c10d._get_default_group()
    declared = getattr(pg, "comm_device_type", None) or getattr(pg, "bound_device_id", None)
    if declared is not None:
        return torch.device(declared).type
    backend = dist.get_backend()
    if backend == "nccl" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def check_divides(value: Any, size: int, message: str) -> None:
    """The one "degree divides size" rule (init_mesh, the config schema, the config's launch checks): raise
    SeqParError(message) unless `value` is a positive int dividing `size`; "{ok}" in the message becomes the
    divisors of `size` (the values that would do)."""
    if isinstance(value, int) and value >= 1 and size % value == 0:
        return
    raise SeqParError(message.replace("{ok}", ", ".join(str(d) for d in divisors(size))))


def check_ulysses_divides(mesh: SequenceParallelMesh, n: int, owner: str, what: str) -> None:
    """SeqParError unless the mesh's Ulysses degree divides `n` (a layer's heads or channels: each Ulysses rank must
    own whole ones), naming the degrees that would."""
    u = mesh.ulysses_degree
    if n % u != 0:
        raise SeqParError(
            f"{owner} has {n} {what}, which the Ulysses degree {u} does not divide: use a ulysses_degree among "
            f"{[d for d in divisors(n) if mesh.sp_size % d == 0]} (the rest as ring_degree)")


def resolve_degrees(sp_size: int, ulysses_degree: int | None, ring_degree: int | None,
                    num_heads: int | None = None, num_kv_heads: int | None = None, *,
                    recurrent: RecurrentHeads | None = None, node_size: int | None = None) -> tuple[int, int]:
    """(ulysses, ring) as the mesh takes them: both given, one given (the other is sp_size // it), or neither
    (`auto_degrees`). The degrees given must divide sp_size (`check_divides`)."""
    if ulysses_degree is None and ring_degree is None:
        return auto_degrees(sp_size, num_heads, num_kv_heads, recurrent=recurrent, node_size=node_size)
    if ulysses_degree is None:
        return sp_size // ring_degree, ring_degree
    if ring_degree is None:
        return ulysses_degree, sp_size // ulysses_degree
    return ulysses_degree, ring_degree


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
    node_size: int | None = None,
    timeout: timedelta | None = None,
    state_passing: str = "chain",
) -> SequenceParallelMesh:
    """Build the dp x ring x ulysses mesh. Needs torch.distributed initialised unless world size is 1.

    dp = world_size // sp_size. ulysses_degree * ring_degree must equal sp_size; give one, both or
    neither (automatic, see `auto_degrees`; pass head counts or an HF `model_config` for the best
    choice: a hybrid model's config also bounds the Ulysses degree by its recurrent layers' heads). `layout` is
    the ring sequence layout: "zigzag" (causal load balance, default) or "contiguous". node_size: processes per
    node (default: LOCAL_WORLD_SIZE, see `node_size_from_env`); the automatic degrees keep each Ulysses group
    inside a node, explicit degrees that do not get a warning naming the fix. timeout: for every process group
    the mesh creates (default: the default group's, as init_process_group(timeout=) set it). Every check runs
    before any process group is created. state_passing: how ring ranks combine the recurrent layers' states of
    hybrid models (Gated DeltaNet, Mamba2): "chain" (sequential point-to-point hand-off) or "scan" (one
    all-gather, each rank composes its prefix); both exact, docs/benchmarks.md compares their cost.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    num_heads, num_kv_heads = _check_mesh_args(sp_size, ulysses_degree, ring_degree, num_heads, num_kv_heads,
                                               model_config, layout, world)
    node = node_size if node_size is not None else node_size_from_env(world)
    if not isinstance(node, int) or node < 1:
        raise SeqParError(f"node_size={node!r} must be a positive int (processes per node)")
    if state_passing not in STATE_PASSING:
        raise SeqParError(f"state_passing={state_passing!r} is unknown: use one of {STATE_PASSING}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise SeqParError(f"timeout={timeout!r} must be a datetime.timedelta (e.g. timedelta(minutes=30)) or None")
    rec = recurrent_heads(model_config) if model_config is not None else None
    ulysses_degree, ring_degree = resolve_degrees(sp_size, ulysses_degree, ring_degree, num_heads, num_kv_heads,
                                                  recurrent=rec, node_size=node)
    if ulysses_degree * ring_degree != sp_size:
        raise SeqParError(
            f"ulysses_degree={ulysses_degree} x ring_degree={ring_degree} = {ulysses_degree * ring_degree} "
            f"!= sp_size={sp_size}: choose degrees whose product is sp_size"
        )
    if world == 1:
        return SequenceParallelMesh(dp_size=1, ring_degree=1, ulysses_degree=1, layout=layout,
                                    state_passing=state_passing)
    span = spans_nodes_message(ulysses_degree, ring_degree, node)
    if span is not None and dist.get_rank() == 0:
        warnings.warn(span, stacklevel=2)
    mesh = _build_mesh(world, sp_size, ulysses_degree, ring_degree, layout, device_type or _device_type(), timeout)
    mesh.state_passing = state_passing
    return mesh


def _check_mesh_args(sp_size: Any, ulysses_degree: Any, ring_degree: Any, num_heads: int | None,
                     num_kv_heads: int | None, model_config: Any, layout: str,
                     world: int) -> tuple[int | None, int | None]:
    """init_mesh's checks of the sizes, layout and heads; returns the head counts (from model_config if given)."""
    if not isinstance(sp_size, int) or sp_size < 1:
        raise SeqParError(f"sp_size must be a positive int, got {sp_size!r}")
    if layout not in LAYOUTS:
        raise SeqParError(f"layout={layout!r} is unknown: use one of {LAYOUTS}")
    check_divides(sp_size, world, f"sp_size={sp_size} does not divide world_size={world}: use one of {{ok}}")
    if model_config is not None and num_heads is None:
        num_heads, num_kv_heads = _heads_from_config(model_config)
    if num_heads is not None:
        kv = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads < 1 or kv < 1 or num_heads % kv != 0:
            raise SeqParError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={kv}")
    for name, val in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if val is not None:
            check_divides(val, sp_size, f"{name}={val!r} must divide sp_size={sp_size}: use one of {{ok}}")
    return num_heads, num_kv_heads


def _build_mesh(world: int, sp_size: int, ulysses_degree: int, ring_degree: int, layout: str, device_type: str,
                timeout: timedelta | None) -> SequenceParallelMesh:
    """The DeviceMesh and its process groups (collective: every rank calls it in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

    dp = world // sp_size
    ranks = torch.arange(world).reshape(dp, ring_degree, ulysses_degree)
    override = tuple(group_timeout_override(timeout, n) for n in (dp, ring_degree, ulysses_degree))
    dm = DeviceMesh(device_type, ranks, mesh_dim_names=("dp", "ring", "ulysses"), backend_override=override)
    sp_mesh = dm["ring", "ulysses"]._flatten("sp", backend_override=group_timeout_override(timeout, sp_size))
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


def _default_group_timeout() -> timedelta | None:
    """The default process group's timeout (None where torch does not say)."""
    pg = dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(next(iter(pg._device_types))).options._timeout
    except (AttributeError, RuntimeError, StopIteration):
        return None


def group_timeout_override(timeout: timedelta | None, size: int) -> tuple[str | None, Any]:
    """The DeviceMesh `backend_override` entry for a mesh dimension of `size` ranks whose groups must time
    out after `timeout` (None: the default group's timeout).

    Without an override DeviceMesh reuses the default group for a dimension spanning the world and creates
    every other group with torch's global default timeout (30 minutes; torch/distributed/device_mesh.py,
    `_init_one_process_group` -> new_group(timeout=None)), whatever init_process_group(timeout=) said.
    (None, None) keeps the default group where it already has the timeout (no extra communicator).
    """
    default = _default_group_timeout()
    want = timeout if timeout is not None else default
    if want is None or (size == dist.get_world_size() and want == default):
        return None, None
    backend = str(dist.get_backend())
    if "nccl" in backend:  # NCCL groups take their own Options type (gloo's ignores pg_options)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
    else:
        from torch._C._distributed_c10d import Backend as _C10dBackend

        opts = _C10dBackend.Options(backend)
    opts._timeout = want
    return None, opts
