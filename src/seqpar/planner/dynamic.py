"""The planner's side of length-aware SP: its time model as a `seqpar.dynamic.cost.RowCost` (the cost of one
micro-batch, shared with `seqpar train`'s balancing), the degrees a world uses, and the largest
max_local_tokens the memory model fits at every one of them.

`row_cost` evaluates this planner's own time model (planner.time.estimate_time, planner.collectives) for one
row per degree and keeps its terms per token / per call: the per-token work (matmuls, activation streaming, the
loss), attention at the ring's piece plan and the machine's attention rate, each per-micro-batch collective
(calls; bytes per token), the host's per-pass cost, FSDP2's all-gathers; the optimizer's streaming and the
per-step collectives (gradient sums, FSDP2's reduce-scatter, book-keeping) go to `step_s`.
RowCost.rank_seconds([[L]], d) + step_s is then estimate_time's step time for one row of L tokens at degree d
(tests/test_dynamic_plan.py: equal on a cluster without overlap, within the overlap rules' difference on GPUs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..dynamic.cost import CommLine, DegreeCost, RowCost
from ..errors import SeqParError
from ..layout import round_up_length
from ..mesh import auto_degrees, divisors
from .collectives import step_collectives
from .gpus import Cluster
from .memory import Features, Layout, Workload, estimate_memory
from .model import ModelFacts
from .search import usable_bytes
from .time import adamw_s, attention_passes, estimate_time, matmul_rate, offload_s, param_tensors, recurrent_flops

if TYPE_CHECKING:
    from ..train.config import TrainConfig

__all__ = ["PER_MICRO_BATCH", "world_degrees", "row_cost", "step_constant_s", "max_local_tokens",
           "check_max_local_tokens", "degree_needed", "check_config_memory"]

# collectives a micro-batch issues (the rest of a step's are issued once per step)
PER_MICRO_BATCH = ("ulysses", "ring", "plan", "ulysses_recurrent", "halo", "state")
FSDP_PER_PASS = ("fsdp_gather", "fsdp_ref_gather")


def world_degrees(m: ModelFacts, world: int, node_size: int | None = None,
                  top: int | None = None) -> dict[int, tuple[int, int]]:
    """{degree: (ulysses, ring)} for every degree dividing `world` (up to `top`), split as `size: d` would
    (seqpar.mesh.auto_degrees: heads, a hybrid's recurrent heads, processes per node)."""
    rec = m.recurrent.ulysses if m.recurrent is not None else None
    out = {}
    for d in divisors(world):
        if top is None or d <= top:
            out[d] = auto_degrees(d, m.heads, m.kv_heads, recurrent=rec, node_size=node_size)
    return out


def _group(lay: Layout, group: str) -> tuple[int, int]:
    return {"ulysses": (lay.ulysses, 1), "ring": (lay.ring, lay.ulysses), "sp": (lay.sp, 1),
            "dp": (lay.dp, lay.sp), "world": (lay.world, 1)}[group]


def _probe_len(u: int, r: int) -> int:
    return 2 * u * r * 1024  # a length every split divides: the terms are per token, any length would do


def _degree_cost(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, cl: Cluster) -> DegreeCost:
    w0 = replace(wl, seq_len=_probe_len(lay.ulysses, lay.ring), micro_batch_size=1)
    te = estimate_time(m, w0, lay, feats, cl)
    tokens = w0.rows * w0.seq_len / lay.sp
    per_token = te.parts["matmul"] + te.parts["memory"] - adamw_s(m, w0, lay, feats, cl) + te.parts["loss"]
    comm, fsdp = [], 0.0
    for c in step_collectives(m, w0, lay, feats):
        size, stride = _group(lay, c.group)
        if c.what in PER_MICRO_BATCH:
            comm.append(CommLine(c.what, c.kind, size, stride, c.calls, c.nbytes / tokens))
        elif c.what in FSDP_PER_PASS:
            fsdp += cl.collective_s(c.kind, c.calls, c.nbytes, size, stride)
    rec = recurrent_flops(m, w0, lay) * m.linear_layers / tokens
    return DegreeCost(lay.ulysses, lay.ring, per_token / tokens, tuple(comm), te.parts["host"], fsdp, rec)


def step_constant_s(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, cl: Cluster) -> float:
    """What a step costs once, whatever its micro-batches: the optimizer's streaming, the gradient sums (or
    FSDP2's reduce-scatter), book-keeping, FSDP2's per-tensor cost, host offload. With overlap (GPUs) the
    gradient sums and the reduce-scatter hide behind the last backward (not with bf16's fp32 master weights,
    whose sums follow it), as in the time model."""
    w0 = replace(wl, seq_len=_probe_len(lay.ulysses, lay.ring), micro_batch_size=1)
    total = adamw_s(m, w0, lay, feats, cl)
    for c in step_collectives(m, w0, lay, feats):
        if c.what in PER_MICRO_BATCH or c.what in FSDP_PER_PASS:
            continue
        s = cl.collective_s(c.kind, c.calls, c.nbytes, *_group(lay, c.group))
        hidden = cl.overlap and (c.what == "fsdp_reduce" or (c.what == "grads" and not (
            wl.precision == "bf16" and not feats.fsdp)))
        total += 0.0 if hidden else s
    if feats.fsdp and lay.world > 1:
        total += param_tensors(m) * cl.fsdp_param_s
    host = offload_s(m, w0, lay, feats, cl)
    total += host.pop("host_adamw", 0.0) + (0.0 if cl.overlap else sum(host.values()))
    return total


def row_cost(m: ModelFacts, wl: Workload, feats: Features, cl: Cluster, degrees: dict[int, tuple[int, int]],
             world: int, layout: str = "zigzag", step_layout: Layout | None = None) -> RowCost:
    """The planner's RowCost at these degrees (each at dp = world / d). step_layout: the layout whose per-step
    costs `step_s` holds (default: degree 1 over the world: length-aware SP sums gradients over all ranks)."""
    per = tuple((d, _degree_cost(m, wl, Layout(u, r, world // d), feats, cl)) for d, (u, r) in sorted(degrees.items()))
    step_lay = step_layout or Layout(1, 1, world)
    return RowCost(per, m.heads, m.kv_heads, m.head_dim, m.softmax_layers, attention_passes(wl, feats),
                   matmul_rate(wl, cl), layout, cl.machine, step_constant_s(m, wl, step_lay, feats, cl))


def degree_needed(length: int, seqs: int, degrees: dict[int, tuple[int, int]], n: int, layout: str = "zigzag") -> int:
    """The smallest degree whose tokens per rank (padded length x seqs / d) are <= n; SeqParError if none."""
    for d in sorted(degrees):
        u, r = degrees[d]
        if seqs * round_up_length(length, r, u, layout) // d <= n:
            return d
    top = max(degrees)
    u, r = degrees[top]
    need = seqs * round_up_length(length, r, u, layout) // top
    raise SeqParError(f"a row of {length} tokens needs {need} tokens per rank at the largest degree {top}, above "
                      f"max_local_tokens={n}: raise max_local_tokens to {need} or more, or use more ranks")


def _fits(m: ModelFacts, wl: Workload, lay: Layout, feats: Features, cl: Cluster, local: int) -> bool:
    return estimate_memory(m, replace(wl, seq_len=local * lay.sp, micro_batch_size=1), lay, feats).total \
        <= usable_bytes(cl)


def max_local_tokens(m: ModelFacts, wl: Workload, feats: Features, cl: Cluster,
                     degrees: dict[int, tuple[int, int]], world: int, multiple: int = 64) -> int:
    """The largest tokens per rank (a multiple of `multiple`) whose memory fits at every degree (each at
    dp = world / d); 0 when not even `multiple` fits. A DPO pair's two rows count as tokens too."""
    def ok(n: int) -> bool:
        local = max(1, n // wl.rows)  # estimate_memory's rows (a DPO pair: 2) share the rank's tokens
        for d, (u, r) in degrees.items():
            step = 2 * u * r if r > 1 else u * r
            seq_len = max(step, (local * d) // step * step)
            if not _fits(m, wl, Layout(u, r, world // d), feats, cl, seq_len // d):
                return False
        return True

    lo, hi = 0, 1
    while ok(hi * multiple) and hi < 2**24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid * multiple) else (lo, mid)
    return lo * multiple


def check_max_local_tokens(m: ModelFacts, wl: Workload, feats: Features, cl: Cluster,
                           degrees: dict[int, tuple[int, int]], world: int, n: int) -> None:
    """Refuse an N the memory model does not fit on this device (SeqParError naming the largest that does)."""
    top = max_local_tokens(m, wl, feats, cl, degrees, world)
    if n > top:
        raise SeqParError(
            f"sequence_parallel.max_local_tokens={n}: the planner's memory model fits at most {top} tokens per rank "
            f"on {cl.mem_bytes / 2**30:.0f} GiB per device ({usable_bytes(cl) / 2**30:.1f} usable) with this "
            f"model and memory settings: set max_local_tokens: {top} or less, or turn on memory features "
            f"(activation_checkpointing, fsdp, tiled_mlp; `seqpar plan --lengths ...` proposes one)")


def check_config_memory(cfg: TrainConfig, world: int, mem_bytes: int, node_size: int | None = None) -> int | None:
    """`seqpar train` / `seqpar check` with size: dynamic on a device of `mem_bytes`: SeqParError when the memory model
    does not fit max_local_tokens at every degree the run uses (its memory settings); returns the bound, or None
    (printing why) when this planner cannot read the model's config (it plans decoders, not VLMs)."""
    from ..train.config import dynamic_degrees
    from ..train.model.load import model_info, tiny_kwargs
    from .model import load_model_facts

    name = cfg.model.name
    try:
        facts = load_model_facts(name, tiny_kwargs(cfg) if name.startswith("tiny:") else None)
    except SeqParError as e:
        print(f"[seqpar] max_local_tokens is not checked against the device memory: {e}", flush=True)
        return None
    info = model_info(cfg)
    degrees = dynamic_degrees(cfg, world, *info.heads, recurrent=info.recurrent, node_size=node_size)
    m, ft = cfg.memory, cfg.finetuning
    feats = Features(activation_checkpointing=m.activation_checkpointing, offload_activations=m.offload_activations,
                     fused_loss=m.fused_loss, tiled_mlp=bool(m.tiled_mlp), tiled_layer=bool(m.tiled_layer),
                     fsdp=bool(cfg.fsdp), offload_optimizer=bool(cfg.fsdp) and cfg.fsdp.offload,
                     loss_chunk_tokens=m.loss_chunk_tokens, attention_head_chunks=m.attention_head_chunks,
                     keep_attention=m.keep_attention)
    targets = tuple(ft.targets) if isinstance(ft.targets, list) else ("q_proj", "k_proj", "v_proj", "o_proj")
    wl = Workload(0, "dpo" if cfg.stage == "dpo" else "sft", ft.method, "fp32" if cfg.precision == "fp32" else "bf16",
                  lora_r=ft.r, lora_targets=targets)
    from .gpus import make_cluster

    cl = make_cluster(world, node_size, gpu_mem=str(mem_bytes))
    check_max_local_tokens(facts, wl, feats, cl, degrees, world, cfg.sequence_parallel.max_local_tokens)
    return max_local_tokens(facts, wl, feats, cl, degrees, world)
