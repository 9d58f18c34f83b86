"""What length-aware SP (`sequence_parallel: {size: dynamic}`) adds to a run's loop, built once: every degree's
mesh (seqpar.dynamic.meshes), the scheduler with the planner's cost model of a micro-batch (seqpar.dynamic.cost)
fed from the live model, one collator per degree, and an idle rank's one-token batch. The step itself:
loop/dynamic_step.py.

The cost model's inputs here come from the model being trained (its linear weights, heads, layers, vocabulary)
and the device it trains on, timed at the start (`device_machine`, seqpar.dynamic.device; every rank takes the
slowest rank's numbers): on an accelerator its matmul rate in the run's precision and its attention kernel's rate
at 256 / 1024 / 4096 tokens (links and latencies stay the planner's H100 numbers, the loss's per-logit cost H100's
HBM); on a CPU its matmul rate, which scales the shape this repository's 2-core machine measured
(seqpar.planner.calibrate, 4 gloo ranks: attention by length, host cost per layer; the gloo collectives as
measured there). The activations' memory streaming,
which the planner's memory model prices, is left out of the trainer's per-token term (it scales with tokens
like the matmuls, so the balance barely moves); `seqpar plan --lengths` prices it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ...attention.costs import attention_comm
from ...attention.ulysses import head_plan, sent_heads
from ...data import SequenceParallelCollator, SequenceParallelDPOCollator, VisionCollator, VisionDPOCollator
from ...dynamic.cost import CommLine, DegreeCost, Machine, RowCost
from ...dynamic.device import agree, attention_rates, matmul_flops
from ...dynamic.meshes import DegreeMeshes
from ...dynamic.schedule import Row, Scheduler
from ...hf.attention import check_mesh
from ..config import TrainConfig
from ..model.load import ModelInfo

__all__ = ["DynamicRun", "build_dynamic", "trainer_row_cost", "device_machine", "CPU_MACHINE", "example_rows",
           "dummy_batch"]

# seqpar.planner.calibrate.measure_cluster(4) on this repository's 2-core machine (4 gloo ranks, load ~6 from
# other sessions): fp32 matmuls 16 GFLOP/s, the causal CPU kernel 3.2-11 GFLOP/s from 256 to 4096 tokens.
CPU_MACHINE = Machine(
    gpus_per_node=2**20, overlap=False, host_layer_s=2.7e-3,
    attn_by_len=((256, 3.2e-3), (1024, 5.4e-3), (4096, 11.4e-3)),
    per_kind=(("all_to_all", 4.1e-3, 2.0), ("p2p", 4.0e-3, 3.9), ("all_reduce", 8e-4, 0.26),
              ("all_gather", 1.8e-3, 0.44), ("reduce_scatter", 6e-3, 0.29)))
CPU_MATMUL_FLOPS = 16e9
CPU_LOSS_ELEM_S = 2.7e-8  # cross-entropy seconds per logit (forward + backward)
# The planner's H100 preset (planner.gpus): 16 bytes per logit at HBM speed.
GPU_LOSS_ELEM_S = 16 / 3350e9


@dataclass
class DynamicRun:
    meshes: DegreeMeshes
    scheduler: Scheduler
    collators: dict[int, Any]  # degree -> the collator of its group view
    lockstep: bool  # every forward is collective over the world (FSDP2): idle ranks run a dummy pass
    stage: str


def _passes(cfg: TrainConfig) -> tuple[int, int]:
    """(forward passes followed by a backward, reference forward passes) per micro-batch."""
    ref = (cfg.stage == "dpo" and cfg.dpo.loss_type != "simpo") or (cfg.stage == "grpo" and cfg.grpo.beta > 0)
    return 1 + int(cfg.memory.activation_checkpointing), int(ref)


def _linear_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(weights of every Linear, those trained): 2 FLOPs each per token and forward pass."""
    total = trained = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            total += mod.weight.numel()
            trained += mod.weight.numel() if mod.weight.requires_grad else 0
    return total, trained


def _comm(cfg: TrainConfig, info: ModelInfo, u: int, r: int, fwds: int, layers: int, head_dim: int) -> list:
    """Per-micro-batch collectives of degree u x r, bytes per local token (attention.costs.attention_comm)."""
    nh, nkv = info.heads
    hq, hkv = sent_heads(head_plan(nh, nkv, u)) if u > 1 else (nh, nkv)
    probe = 2 * u * r * 1024
    elt = 2 if cfg.precision != "fp32" else 4
    c = attention_comm(probe, 1, hq, hkv, head_dim, u, r, elt, fwds, layers)
    tokens = probe / (u * r)
    out = []
    if u > 1:
        out.append(CommLine("ulysses", "all_to_all", u, 1, c.ulysses[0], c.ulysses[1] / tokens))
    if r > 1:
        out.append(CommLine("ring", "p2p", r, u, c.ring[0], c.ring[1] / tokens))
    if u * r > 1:
        calls = 1 + _passes(cfg)[1]
        out.append(CommLine("plan", "all_gather", u * r, 1, calls, 8.0 * calls))
    return out


def device_machine(cfg: TrainConfig, device: torch.device, head_dim: int, group: Any = None,
                   comm_device: torch.device | None = None) -> tuple[Machine, float]:
    """(machine, matmul FLOP/s) of the device this run trains on, timed now and agreed over `group` (the module
    docstring)."""
    cpu = device.type == "cpu"
    dtype = torch.float32 if cpu or cfg.precision == "fp32" else torch.bfloat16
    mm = matmul_flops(device, dtype)
    attn = () if cpu else attention_rates(device, dtype, head_dim)
    vals = agree([mm, *(r for _, r in attn)], group, comm_device or device)
    if cpu:  # this machine's speed, the measured machine's shape
        k = vals[0] / CPU_MATMUL_FLOPS
        return replace(CPU_MACHINE, host_layer_s=CPU_MACHINE.host_layer_s / k,
                       attn_by_len=tuple((n, r * k) for n, r in CPU_MACHINE.attn_by_len)), vals[0]
    return Machine(attn_by_len=tuple((n, r) for (n, _), r in zip(attn, vals[1:]))), vals[0]


def trainer_row_cost(cfg: TrainConfig, model: torch.nn.Module, info: ModelInfo, degrees: dict[int, tuple[int, int]],
                     world: int, device: torch.device, machine: tuple[Machine, float] | None = None) -> RowCost:
    """The cost model of this run's micro-batches (module docstring: the inputs the live model gives); machine:
    device_machine's (default: timed here, on this rank alone)."""
    text = getattr(info.config, "text_config", None) or info.config
    nh, nkv = info.heads
    layers = int(getattr(text, "num_hidden_layers", 1) or 1)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // nh)
    rec = getattr(text, "layer_types", None) or ()
    attn_layers = layers - sum(str(t) in ("linear_attention", "mamba") for t in rec)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    cpu = device.type == "cpu"
    machine, rate = machine or device_machine(cfg, device, head_dim)
    fwd_bwd, fwd_only = _passes(cfg)
    weights, trained = _linear_weights(model)
    per_token = 2 * (weights * (fwd_bwd + fwd_only) + weights + trained) / rate
    per_token += vocab * (1 + fwd_only / 3) * (CPU_LOSS_ELEM_S if cpu else GPU_LOSS_ELEM_S)
    host = machine.host_layer_s * layers * (fwd_bwd + fwd_only + 1)
    fsdp = 0.0
    if cfg.fsdp and world > 1:
        elt = 4 if cfg.precision == "fp32" else 2
        params = sum(p.numel() for p in model.parameters())
        fsdp = machine.collective_s("all_gather", (2 + fwd_only) * layers + 1,
                                    (2 + fwd_only) * params * elt * (world - 1) / world, world)
    kept = int(cfg.memory.keep_attention and cfg.memory.activation_checkpointing)
    per = tuple((d, DegreeCost(u, r, per_token, tuple(_comm(cfg, info, u, r, fwd_bwd + fwd_only, attn_layers,
                                                                head_dim)), host, fsdp))
                for d, (u, r) in sorted(degrees.items()))
    return RowCost(per, nh, nkv, head_dim, attn_layers, fwd_bwd - kept + fwd_only + 2.5, rate,
                   cfg.sequence_parallel.layout, machine)


def _collator(cfg: TrainConfig, mesh: Any, pad: int, vlm: bool) -> Any:
    """The collator of one degree's slots: SFT rows packed (documents with cu_seqlens); DPO pairs and GRPO rows
    batched (right-padded), as the fixed run collates them."""
    ds = cfg.dataset
    if cfg.stage == "dpo":
        return (VisionDPOCollator if vlm else SequenceParallelDPOCollator)(mesh, pad, max_length=ds.max_length)
    kind = VisionCollator if vlm else SequenceParallelCollator
    if cfg.stage == "sft":
        return kind(mesh, pad, packing=True, max_length=None)
    return kind(mesh, pad, packing=False, max_length=ds.max_length)


def build_dynamic(cfg: TrainConfig, meshes: DegreeMeshes, model: torch.nn.Module, tok: Any, info: ModelInfo,
                  degrees: dict[int, tuple[int, int]], device: torch.device) -> DynamicRun:
    """The scheduler, collators and meshes of a size: dynamic run (the model already prepared and wrapped)."""
    for d in meshes.degrees:
        check_mesh(model, meshes.view(d))
    text = getattr(info.config, "text_config", None) or info.config
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // info.heads[0])
    world_mesh = meshes.world_mesh
    machine = device_machine(cfg, device, head_dim, world_mesh.dp_group if meshes.world > 1 else None,
                             world_mesh.comm_device)
    cost = trainer_row_cost(cfg, model, info, degrees, meshes.world, device, machine)
    sched = Scheduler(cost, meshes.world, cfg.sequence_parallel.max_local_tokens, sorted(degrees),
                      packed=cfg.stage == "sft")
    collators = {d: _collator(cfg, meshes.view(d), tok.pad_token_id, info.vlm) for d in meshes.degrees}
    return DynamicRun(meshes, sched, collators, lockstep=bool(cfg.fsdp), stage=cfg.stage)


def example_rows(cfg: TrainConfig, examples: list, idx: list[int]) -> list[Row]:
    """The scheduler's rows for SFT examples / DPO pairs (lengths as the collators will see them)."""
    cap = cfg.dataset.max_length
    if cfg.stage == "dpo":
        out = []
        for j, i in enumerate(idx):
            e = examples[i]
            p = len(e["prompt_input_ids"])
            n = max(p + len(e["chosen_input_ids"]), p + len(e["rejected_input_ids"]))
            out.append(Row(j, min(n, cap), 2))
        return out
    return [Row(j, min(len(examples[i]["input_ids"]), cap)) for j, i in enumerate(idx)]


def dummy_batch(run: DynamicRun, pad: int) -> dict[str, Any]:
    """An idle rank's one-token micro-batch at degree 1 (its loss is multiplied by 0: no loss, no gradient)."""
    collate = run.collators[1]
    if run.stage == "dpo":
        return collate([{"prompt_input_ids": [pad], "chosen_input_ids": [pad], "rejected_input_ids": [pad]}])
    b = collate([{"input_ids": [pad, pad], "labels": [-100, -100]}])
    if run.stage == "grpo":
        b["advantages"] = torch.zeros(1)
    return b
