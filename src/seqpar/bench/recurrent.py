"""Recurrent-layer benchmark: state passing across a ring vs the Ulysses path at the same SP size (CPU, gloo).

One Gated DeltaNet layer (transformers' Qwen3.5 module) and one Mamba2 mixer (Nemotron-H's), random weights,
run through seqpar's SP forward (seqpar.hf.linear_attention / mamba2) on a full sequence of `seq_len` tokens,
forward + backward of a fixed random weighting of the output. Per SP size P (a world of P gloo ranks, 1 thread
each) and mesh: "sp1" (every rank the whole sequence: the one-process cost under the same load), "ulysses"
(P = Ulysses degree: two all-to-alls, whole sequences per head group), "ring-chain" / "ring-scan" (P = ring
degree: conv halo + state passing, the two combine modes of seqpar.recurrent.combine) and at P = 4 "usp"
(2 x 2). Per point: the slowest rank's median seconds over `reps` timed repetitions after one warm-up, the
bytes each rank sent per channel (seqpar.comm's counters: ulysses all-to-alls, state hops, all-gathers of the
halo / the scan) and the planner's bytes for the same layer's forward + backward (planner.recurrent). The two
count differently, by a fixed factor the smoke test checks: the planner adds the all-gathers' backward
reduce-scatters (same bytes; seqpar.comm counts the forward all-gather only), and its chain "state" is the
bytes on a rank's critical path (the 2R-2 hops of one state under zigzag, forward and backward), where a rank
itself sends one or two states per direction. The figure of merit: ring time / Ulysses time at the same P.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from typing import Any

import torch

__all__ = ["run", "summary_lines", "LAYERS"]

# (config class, overrides): 4 Gated DeltaNet k heads / 8 Mamba2 heads in 2 groups, so Ulysses 2 and 4 both run.
LAYERS: dict[str, dict[str, Any]] = {
    "gated_deltanet": {"hidden": 256, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                       "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4},
    "mamba2": {"hidden": 256, "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 32, "n_groups": 2,
               "conv_kernel": 4, "chunk_size": 64},
}
MODES = {2: ("sp1", "ulysses", "ring-chain", "ring-scan"), 4: ("sp1", "ulysses", "ring-chain", "ring-scan", "usp")}


def _layer(kind: str, quick: bool) -> torch.nn.Module:
    from ..hf.models import tiny_config

    kw = dict(LAYERS[kind])
    hidden = 64 if quick else kw.pop("hidden")
    kw.pop("hidden", None)
    arch = "qwen3_5" if kind == "gated_deltanet" else "nemotron_h"
    cfg = tiny_config(arch, 4, 2, hidden_size=hidden, **kw)
    torch.manual_seed(0)
    if kind == "gated_deltanet":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        return Qwen3_5GatedDeltaNet(cfg, 0)
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    return NemotronHMamba2Mixer(cfg, 0)


def _mesh(mode: str, world: int) -> Any:
    from ..mesh import init_mesh

    if mode == "sp1":
        return init_mesh(1)
    if mode == "ulysses":
        return init_mesh(world, ulysses_degree=world, ring_degree=1)
    if mode == "usp":
        return init_mesh(world, ulysses_degree=2, ring_degree=world // 2)
    mesh = init_mesh(world, ulysses_degree=1, ring_degree=world)
    return dataclasses.replace(mesh, state_passing=mode.split("-")[1])


def _time_one(layer: torch.nn.Module, kind: str, mesh: Any, x: torch.Tensor, w: torch.Tensor, reps: int) -> dict:
    from ..hf.linear_attention import sp_gated_delta_forward
    from ..hf.mamba2 import sp_mamba2_forward
    from ..layout import shard

    fwd = sp_gated_delta_forward if kind == "gated_deltanet" else sp_mamba2_forward
    xs, ws = shard(x, mesh, 1), shard(w, mesh, 1)
    times, sent = [], {}
    for rep in range(reps + 1):
        mesh.stats.reset()
        xi = xs.detach().requires_grad_()
        layer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        (fwd(layer, xi, None, ((),), mesh) * ws).sum().backward()
        if rep > 0:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
        sent = mesh.stats.snapshot()
    return {"s": statistics.median(times), "bytes": sent}


def _world(seq_len: int, reps: int, quick: bool) -> dict:
    import torch.distributed as dist

    world = dist.get_world_size()
    out: dict[str, Any] = {}
    meshes = {m: _mesh(m, world) for m in MODES[world]}
    for kind in LAYERS:
        layer = _layer(kind, quick)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, seq_len, layer.hidden_size, generator=g)
        w = torch.randn(1, seq_len, layer.hidden_size, generator=g)
        out[kind] = {m: _time_one(layer, kind, mesh, x, w, reps) for m, mesh in meshes.items()}
    return out


def _predicted(kind: str, quick: bool, seq_len: int, u: int, r: int, passing: str) -> dict[str, int]:
    """The planner's bytes of one forward + backward of the layer on one rank (planner.recurrent)."""
    from ..planner.collectives import step_collectives
    from ..planner.model import load_model_facts
    from ..planner.workload import Features, Layout, Workload

    kw = dict(LAYERS[kind])
    hidden = 64 if quick else kw.pop("hidden")
    kw.pop("hidden", None)
    kw["layers_block_type" if kind == "mamba2" else "layer_types"] = ["linear_attention", "full_attention"]
    if kind == "mamba2":  # the planner models Granite-style layers (mixer + MLP): same mixer, same collectives
        kw = {"mamba_n_heads": kw["mamba_num_heads"], "mamba_d_head": kw["mamba_head_dim"], "num_local_experts": 0,
              "mamba_d_state": kw["ssm_state_size"], "mamba_n_groups": kw["n_groups"], "mamba_d_conv": 4,
              "mamba_chunk_size": kw["chunk_size"], "layer_types": ["linear_attention", "full_attention"],
              "mamba_expand": kw["mamba_num_heads"] * kw["mamba_head_dim"] // hidden}
    arch = "qwen3_5" if kind == "gated_deltanet" else "granitemoehybrid"
    m = load_model_facts(f"tiny:{arch}", {"hidden_size": hidden, **kw})
    wl = Workload(seq_len, precision="fp32", state_passing=passing)
    coll = step_collectives(m, wl, Layout(u, r, 1), Features(fused_loss=False))
    return {c.what: c.nbytes for c in coll if c.what in ("ulysses_recurrent", "halo", "state")}


def run(quick: bool = False, seq_len: int | None = None, reps: int = 3, sp_sizes: tuple[int, ...] = (2, 4),
        timeout: float = 1200.0) -> dict:
    from ..spawn import run_distributed

    seq_len = seq_len or (64 if quick else 4096)
    reps = 1 if quick else reps
    result: dict[str, Any] = {"benchmark": "recurrent", "quick": quick, "seq_len": seq_len, "reps": reps,
                              "layers": LAYERS, "machine": platform.machine(), "torch": torch.__version__,
                              "threads_per_rank": 1, "loadavg_start": os.getloadavg(), "points": []}
    for p in sp_sizes:
        per_rank = run_distributed(_world, p, seq_len, reps, quick, timeout=timeout)
        for kind in LAYERS:
            base = max(r[kind]["ulysses"]["s"] for r in per_rank)
            for mode in MODES[p]:
                s = max(r[kind][mode]["s"] for r in per_rank)
                u, r_deg = {"sp1": (1, 1), "ulysses": (p, 1), "usp": (2, p // 2)}.get(mode, (1, p))
                point = {"layer": kind, "sp": p, "mode": mode, "ulysses": u, "ring": r_deg, "seconds": s,
                         "vs_ulysses": s / base, "bytes_per_rank": [r[kind][mode]["bytes"] for r in per_rank]}
                if mode != "sp1":
                    point["planner_bytes"] = _predicted(kind, quick, seq_len, u, r_deg,
                                                        mode.split("-")[1] if "-" in mode else "chain")
                result["points"].append(point)
    result["loadavg_end"] = os.getloadavg()
    return result


def summary_lines(result: dict) -> list[str]:
    lines = [f"recurrent layers, {result['seq_len']} tokens, fwd+bwd seconds (slowest rank), "
             "vs Ulysses at the same SP:"]
    for p in result["points"]:
        sent = max(sum(b.values()) for b in p["bytes_per_rank"])
        lines.append(f"  {p['layer']:>15} sp={p['sp']} {p['mode']:>10}: {p['seconds'] * 1e3:8.1f} ms  "
                     f"x{p['vs_ulysses']:.2f}  sent {sent / 1e6:7.2f} MB")
    return lines
