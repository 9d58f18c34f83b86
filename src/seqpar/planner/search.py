"""Enumerate ulysses x ring x dp and memory-feature sets, predict memory and time, rank, recommend."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import yaml

from ..attention.ulysses import head_plan
from ..errors import SeqParError
from ..layout import required_multiple
from ..mesh import divisors
from .gpus import Cluster
from .memory import Features, Layout, MemoryBreakdown, Workload, estimate_memory
from .model import ModelFacts
from .time import TimeEstimate, estimate_time

__all__ = ["Candidate", "Request", "plan", "usable_bytes", "MARGIN_FRACTION", "MARGIN_BYTES", "train_yaml"]

# Headroom the planner keeps free: allocator fragmentation (fraction) + CUDA context, NCCL buffers,
# kernels' workspaces (bytes). See docs/planner.md.
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 2 * 2**30


def usable_bytes(cl: Cluster) -> int:
    return int(cl.mem_bytes * (1 - MARGIN_FRACTION)) - MARGIN_BYTES


@dataclass(frozen=True)
class Request:
    """What to search. None = try both / all."""

    workload: Workload
    ulysses_degree: int | None = None
    ring_degree: int | None = None
    activation_checkpointing: bool | None = None
    fused_loss: bool = True
    tiled_mlp: bool = False
    offload_activations: bool = False
    offload_optimizer: bool = False
    fsdp: bool | None = None
    max_seq_len: bool = False


@dataclass
class Candidate:
    layout: Layout
    features: Features
    memory: MemoryBreakdown
    time: TimeEstimate
    fits: bool
    dummy_heads: int
    kv_replication: int
    seq_len: int
    max_seq_len: int | None = None

    def as_json(self) -> dict[str, Any]:
        d = {"ulysses_degree": self.layout.ulysses, "ring_degree": self.layout.ring, "dp_size": self.layout.dp,
             "features": self.features.as_dict(), "memory_bytes": self.memory.as_dict(),
             "peak_phase": self.memory.phase,
             "step_time_s": self.time.step_s, "compute_s": self.time.compute_s,
             "exposed_comm_s": self.time.exposed_comm_s, "comm_bytes_per_layer": self.time.comm_bytes_per_layer,
             "step_time_parts_s": dict(self.time.parts),
             "dummy_heads": self.dummy_heads, "kv_replication": self.kv_replication, "seq_len": self.seq_len,
             "fits": self.fits}
        if self.max_seq_len is not None:
            d["max_seq_len"] = self.max_seq_len
        return d


def _feature_sets(req: Request) -> list[Features]:
    ac = [req.activation_checkpointing] if req.activation_checkpointing is not None else [False, True]
    fsdp = [req.fsdp] if req.fsdp is not None else [False, True]
    out = []
    for a, f in itertools.product(ac, fsdp):
        if req.offload_activations and not a:
            continue  # offload moves the checkpointed layer inputs: it needs checkpointing
        if req.offload_optimizer and not f:
            continue
        out.append(Features(activation_checkpointing=a, offload_activations=req.offload_activations and a,
                            fused_loss=req.fused_loss, tiled_mlp=req.tiled_mlp, fsdp=f,
                            offload_optimizer=req.offload_optimizer and f))
    if not out:
        raise SeqParError("--offload-activations needs activation checkpointing and --offload-optimizer needs FSDP: "
                          "drop --no-activation-checkpointing / --no-fsdp")
    return out


def _layouts(m: ModelFacts, cl: Cluster, req: Request) -> list[Layout]:
    u_fix, r_fix = req.ulysses_degree, req.ring_degree
    for name, v in (("--ulysses-degree", u_fix), ("--ring-degree", r_fix)):
        if v is not None and (v < 1 or cl.gpus % v != 0):
            raise SeqParError(f"{name} {v} must divide --gpus {cl.gpus}: use one of "
                              f"{', '.join(map(str, divisors(cl.gpus)))}")
    out = []
    for sp in divisors(cl.gpus):
        for u in divisors(sp):
            r = sp // u
            if (u_fix is None or u == u_fix) and (r_fix is None or r == r_fix):
                out.append(Layout(u, r, cl.gpus // sp))
    if not out:
        raise SeqParError(f"no mesh has ulysses={u_fix} x ring={r_fix} dividing --gpus {cl.gpus}: "
                          "their product must divide the GPU count")
    return out


def _multiple(lay: Layout) -> int:
    return required_multiple(lay.ring, lay.ulysses, "zigzag")


def _evaluate(m: ModelFacts, cl: Cluster, wl: Workload, lay: Layout, f: Features) -> Candidate:
    mem = estimate_memory(m, wl, lay, f)
    t = estimate_time(m, wl, lay, f, cl)
    plan = head_plan(m.heads, m.kv_heads, lay.ulysses) if lay.ulysses > 1 else None
    dummy = plan.dummy_heads if plan else 0
    rep = (plan.expanded_kv_heads // m.kv_heads) if plan else 1
    return Candidate(lay, f, mem, t, mem.total <= usable_bytes(cl), dummy, rep, wl.seq_len)


def _longest(m: ModelFacts, cl: Cluster, wl: Workload, lay: Layout, f: Features) -> Candidate:
    """The longest multiple of the mesh's split that fits (memory grows with the length)."""
    step = _multiple(lay)
    lo, hi = 0, 1
    while _evaluate(m, cl, replace(wl, seq_len=hi * step), lay, f).fits and hi < 2**40 // step:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _evaluate(m, cl, replace(wl, seq_len=mid * step), lay, f).fits else (lo, mid)
    c = _evaluate(m, cl, replace(wl, seq_len=max(lo, 1) * step), lay, f)
    c.max_seq_len = lo * step
    c.fits = lo > 0
    return c


TIE = 0.02  # step times within 2% of the fastest comparable candidate are a tie (the model's error is larger)


def _speed_key(c: Candidate, fastest: dict[Any, float], group: Any) -> float:
    """0 for candidates tied with the fastest of their group, else the step time."""
    t = c.time.step_s
    return 0.0 if t <= fastest[group] * (1 + TIE) else t


def _intra_ulysses(c: Candidate, cl: Cluster) -> int:
    """Tie-break: the largest ulysses degree that stays inside a node (one all-to-all on NVLink beats
    r ring steps of smaller, less efficient attention blocks)."""
    return c.layout.ulysses if c.layout.ulysses <= cl.gpus_per_node and c.dummy_heads == 0 else 0


def plan(m: ModelFacts, cl: Cluster, req: Request) -> tuple[list[Candidate], int | None]:
    """All candidates, best first, and the index of the recommended one (None if nothing fits)."""
    wl = req.workload
    if not req.max_seq_len and wl.seq_len < 1:
        raise SeqParError(f"--seq-len must be positive, got {wl.seq_len}")
    if usable_bytes(cl) <= 0:
        raise SeqParError(f"--gpu-mem {cl.mem_bytes} bytes leaves nothing after the planner's margin "
                          f"({MARGIN_FRACTION:.0%} + {MARGIN_BYTES / 2**30:.0f} GiB): give the real GPU memory")
    layouts = _layouts(m, cl, req)
    if not req.max_seq_len:
        ok = [lay for lay in layouts if wl.seq_len % _multiple(lay) == 0]
        if not ok:
            need = sorted({_multiple(lay) for lay in layouts})
            raise SeqParError(f"--seq-len {wl.seq_len} cannot be split over any mesh asked for: it must be a "
                              f"multiple of {' or '.join(map(str, need))} (zigzag ring needs 2*ring*ulysses)")
        layouts = ok
    cands = []
    for lay in layouts:
        for f in _feature_sets(req):
            cands.append(_longest(m, cl, wl, lay, f) if req.max_seq_len else _evaluate(m, cl, wl, lay, f))
    fastest: dict[Any, float] = {}
    group = (lambda c: c.max_seq_len) if req.max_seq_len else (lambda c: None)  # noqa: E731
    for c in cands:
        if c.fits:
            fastest[group(c)] = min(fastest.get(group(c), math.inf), c.time.step_s)
    if req.max_seq_len:
        cands.sort(key=lambda c: (not c.fits, -(c.max_seq_len or 0),
                                  _speed_key(c, fastest, group(c)) if c.fits else 0.0, -_intra_ulysses(c, cl)))
    else:
        # fitting ones by speed; the others by how far they are from fitting
        cands.sort(key=lambda c: (not c.fits, _speed_key(c, fastest, None) if c.fits else c.memory.total,
                                  -_intra_ulysses(c, cl), c.time.step_s, c.memory.total))
    return cands, (0 if cands and cands[0].fits else None)


def why(m: ModelFacts, cl: Cluster, c: Candidate) -> str:
    """One paragraph: why this candidate wins, in the planner's own terms."""
    lay = c.layout
    parts = [f"ulysses={lay.ulysses} x ring={lay.ring} x dp={lay.dp}"]
    if lay.ulysses > 1:
        where = "inside a node (NVLink)" if lay.ulysses <= cl.gpus_per_node else "ACROSS nodes (slow all-to-all)"
        parts.append(f"ulysses all-to-all {where}")
    if lay.ring > 1:
        where = "inside a node" if lay.sp <= cl.gpus_per_node else "across nodes, where its K/V hops overlap compute"
        parts.append(f"ring {where}")
    if c.dummy_heads or c.kv_replication > 1:
        parts.append(f"{m.heads} q / {m.kv_heads} kv heads at ulysses={lay.ulysses}: {c.dummy_heads} dummy q heads, "
                     f"kv heads replicated x{c.kv_replication} (more bytes and FLOPs than a divisible degree)")
    feats = [k for k, v in c.features.as_dict().items() if v]
    parts.append("features: " + (", ".join(feats) or "none"))
    parts.append(f"peak {c.memory.total / 2**30:.1f} GiB at {c.memory.phase} of {usable_bytes(cl) / 2**30:.1f} "
                 f"usable; fastest predicted step among those that fit")
    return "; ".join(parts)


def train_yaml(model_name: str, c: Candidate, wl: Workload, seq_len: int) -> str:
    f = c.features
    cfg: dict[str, Any] = {
        "model": {"name": model_name},
        "dataset": {"path": "data/train.jsonl", "max_length": seq_len, "packing": wl.stage == "sft"},
        "stage": wl.stage,
        "finetuning": {"method": wl.finetuning},
        "sequence_parallel": {"size": c.layout.sp, "ulysses_degree": c.layout.ulysses,
                              "ring_degree": c.layout.ring},
        "fsdp": {"enabled": f.fsdp, "offload": f.offload_optimizer},
        "memory": {"activation_checkpointing": f.activation_checkpointing,
                   "offload_activations": f.offload_activations, "fused_loss": f.fused_loss,
                   "tiled_mlp": f.tiled_mlp},
        "precision": wl.precision,
        "micro_batch_size": wl.micro_batch_size,
    }
    if wl.stage == "dpo" or wl.micro_batch_size > 1:
        cfg["dataset"]["packing"] = False
    return yaml.safe_dump(cfg, sort_keys=False)
