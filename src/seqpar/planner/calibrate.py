"""Measure this machine as a planner `Cluster` (CPU, gloo): the constants `--validate-time` predicts with.

Micro-benchmarks only, run in a spawned world like the validation cases (1 thread per rank): the
achieved fp32 matmul FLOP/s, the causal attention kernel's FLOP/s at a few lengths, the streaming
bandwidth of an elementwise op, each gloo collective kind's latency and bandwidth (a small and a 1 MiB
message; bytes counted as planner.collectives counts them: what one rank sends), FSDP2's fixed cost
per parameter tensor and step, the cross-entropy's cost per logit, and the host's fixed cost per
decoder layer and pass (python, op dispatch). Each is the median of repeated calls.
The validation rows themselves are never used to fit anything.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..dynamic.device import ATTN_LENGTHS, attention_rates, matmul_flops
from .gpus import Cluster, make_cluster

__all__ = ["measure_cluster", "calibration_body"]

_BIG = 1 << 18  # floats: a 1 MiB message


def _typical(fn: Callable[[], Any], reps: int = 15) -> float:
    """Median of `reps` calls after a warm-up: what a training step meets (the fastest call would hide
    the scheduling delays every gloo call pays when all cores are busy)."""
    import torch.distributed as dist

    fn()
    if dist.is_initialized():
        dist.barrier()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rates() -> dict[str, float]:
    cpu = torch.device("cpu")
    mm = matmul_flops(cpu, reps=15)  # the same timings length-aware SP takes of its device (dynamic.device)
    attn = list(attention_rates(cpu, torch.float32, 32, heads=4, lengths=ATTN_LENGTHS, reps=5))
    x, y, z = torch.randn(2048, 768), torch.randn(2048, 768), torch.empty(2048, 768)  # layer-sized
    bw = 3 * x.numel() * 4 / _typical(lambda: torch.mul(x, y, out=z))
    return {"matmul_flops": mm, "attn": attn, "mem_bw": bw}


def _collective_ops(world: int) -> dict[str, Callable[[int], tuple[Callable[[], Any], float]]]:
    """kind -> (n floats -> (call, bytes this rank sends)), the byte convention of planner.collectives."""
    import torch.distributed as dist

    rank, f = dist.get_rank(), (world - 1) / world

    def a2a(n: int) -> tuple[Callable[[], Any], float]:
        x, o = torch.zeros(n * world), torch.empty(n * world)
        return (lambda: dist.all_to_all_single(o, x)), 4 * n * world * f

    def p2p(n: int) -> tuple[Callable[[], Any], float]:
        x, o = torch.zeros(n), torch.empty(n)
        peer = rank ^ 1  # pairs (0, 1), (2, 3), ...
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, o, peer)]
        return (lambda: [w.wait() for w in dist.batch_isend_irecv(ops)]), 4 * n

    def ar(n: int) -> tuple[Callable[[], Any], float]:
        x = torch.zeros(n)
        return (lambda: dist.all_reduce(x)), 2 * 4 * n * f

    def ag(n: int) -> tuple[Callable[[], Any], float]:
        x, o = torch.zeros(n), torch.empty(n * world)
        return (lambda: dist.all_gather_into_tensor(o, x)), 4 * n * world * f

    def rs(n: int) -> tuple[Callable[[], Any], float]:
        x, o = torch.zeros(n * world), torch.empty(n)
        return (lambda: dist.reduce_scatter_tensor(o, x)), 4 * n * world * f

    return {"all_to_all": a2a, "p2p": p2p, "all_reduce": ar, "all_gather": ag, "reduce_scatter": rs}


def _collectives(world: int) -> list[tuple[str, float, float]]:
    out = []
    for kind, make in _collective_ops(world).items():
        small_fn, _ = make(2)
        big_fn, big_bytes = make(_BIG)
        lat = _typical(small_fn, 20)
        per_byte = max(_typical(big_fn) - lat, 1e-9) / big_bytes
        out.append((kind, lat, 1.0 / per_byte / 1e9))
    return out


def _fsdp_param_s(kinds: list[tuple[str, float, float]]) -> float:
    """FSDP2's fixed cost per parameter tensor and step beyond its collectives' latency: DTensor dispatch
    in AdamW and the gradient norm, copies in and out of the flat buffers (large on a CPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..train.config.schema import OptimizerSpec
    from ..train.loop.optim import IMPLEMENTATIONS

    units, world = 4, torch.distributed.get_world_size()
    plain = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(units)])
    sharded = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(units)])
    fmesh = init_device_mesh("cpu", (world,))
    for layer in sharded:
        fully_shard(layer, mesh=fmesh)
    fully_shard(sharded, mesh=fmesh)
    x = torch.randn(8, 64)

    def step(model: torch.nn.Module) -> Callable[[], None]:
        opt = torch.optim.AdamW(model.parameters(), **IMPLEMENTATIONS[OptimizerSpec().implementation])  # as trained

        def run() -> None:
            model(x).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return run

    lat = dict((k, lat) for k, lat, _ in kinds)
    collectives = (2 * units + 1) * lat["all_gather"] + units * lat["reduce_scatter"] + lat["all_reduce"]
    n_params = 2 * units
    return max(0.0, (_typical(step(sharded)) - _typical(step(plain)) - collectives) / n_params)


def _loss_elem_s() -> float:
    """Seconds per logit element of the cross-entropy forward + backward (log-softmax over the vocabulary:
    exp/log make it slower than streaming on a CPU)."""
    logits = torch.randn(1024, 2048, requires_grad=True)
    labels = torch.randint(0, 2048, (1024,))
    return _typical(lambda: torch.nn.functional.cross_entropy(logits, labels).backward()) / logits.numel()


def _host_layer_s() -> float:
    """The host's fixed cost per decoder layer and pass (forward or backward) of a HF model: python and
    op dispatch, measured at a length where the arithmetic is negligible (5 layers minus 1)."""
    from ..hf import tiny_model

    x = torch.randint(0, 128, (1, 16))

    def step(layers: int) -> float:
        model = tiny_model("llama", num_layers=layers, vocab_size=128)
        return _typical(lambda: model(input_ids=x).logits.sum().backward())

    return max(0.0, (step(5) - step(1)) / 4 / 2)


def calibration_body() -> dict[str, Any]:
    """Per-rank body (under seqpar.spawn.run_distributed)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    out: dict[str, Any] = _rates()
    out["per_kind"] = _collectives(world)
    out["fsdp_param_s"] = _fsdp_param_s(out["per_kind"])
    out["loss_elem_s"] = _loss_elem_s()
    out["host_layer_s"] = _host_layer_s()
    return out


def measure_cluster(world: int = 2, timeout: float = 300.0) -> Cluster:
    """This machine as a Cluster of `world` CPU processes (the slowest rank's numbers), no overlap."""
    from ..spawn import run_distributed

    res = run_distributed(calibration_body, world, timeout=timeout)
    worst = {k: min(r[k] for r in res) for k in ("matmul_flops", "mem_bw")}
    attn = tuple((n, min(r["attn"][i][1] for r in res)) for i, (n, _) in enumerate(res[0]["attn"]))
    kinds = [(k, max(r["per_kind"][i][1] for r in res), min(r["per_kind"][i][2] for r in res))
             for i, (k, _, _) in enumerate(res[0]["per_kind"])]
    tflops = worst["matmul_flops"] / 1e12
    return replace(make_cluster(world, world), name="this machine (measured)", peak_tflops=tflops, fp32_tflops=tflops,
                   attn_by_len=attn, mem_bw=worst["mem_bw"] / 1e9, overlap=False,
                   fsdp_param_s=max(r["fsdp_param_s"] for r in res), host_layer_s=max(r["host_layer_s"] for r in res),
                   loss_elem_s=max(r["loss_elem_s"] for r in res),
                   per_kind=tuple(kinds))
