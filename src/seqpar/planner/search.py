"""Enumerate ulysses x ring x dp and memory-feature sets, predict memory and time, rank, recommend."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import yaml

from ..attention.ulysses import head_plan
from ..errors import SeqParError
from ..mesh import check_divides, divisors
from .gpus import Cluster
from .limits import Context, context_limit, padded, refuse_too_long, split_multiple
from .memory import Features, Layout, MemoryBreakdown, Workload, estimate_memory, host_bytes
from .model import ModelFacts
from .tiled import auto_head_chunks
from .time import TimeEstimate, estimate_time

__all__ = ["Candidate", "Request", "plan", "feature_sets", "usable_bytes", "MARGIN_FRACTION", "MARGIN_BYTES",
           "train_yaml"]

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
    tiled_layer: bool = False
    offload_activations: bool = False
    offload_optimizer: bool = False
    fsdp: bool | None = None
    max_seq_len: bool = False
    max_position: int | None = None  # an extended context (config.json's max_position_embeddings)
    rope_scaling: float | None = None  # or a RoPE scaling factor on the model's own
    attention_head_chunks: int | str = 1  # memory.attention_head_chunks, or "auto": planner.tiled.auto_head_chunks
    keep_attention: bool = False  # memory.keep_attention (with checkpointing)


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
    host_bytes: int = 0  # per rank: offloaded layer inputs + CPU-offloaded optimizer
    capped_by: str | None = None  # --max-seq-len stopped at the context limit, not at memory
    rows: int = 1  # rows per micro-batch and dp replica (DPO: chosen + rejected)

    @property
    def sequences(self) -> int:
        """Rows one optimizer step processes over the whole cluster (each dp replica its own)."""
        return self.layout.dp * self.rows

    @property
    def tokens_per_s(self) -> float:
        """Training tokens per second over the cluster: what dp > 1 and dp = 1 rows compare on."""
        return self.sequences * self.seq_len / self.time.step_s if self.time.step_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        d = {"ulysses_degree": self.layout.ulysses, "ring_degree": self.layout.ring, "dp_size": self.layout.dp,
             "features": self.features.as_dict(), "memory_bytes": self.memory.as_dict(),
             "peak_phase": self.memory.phase,
             "step_time_s": self.time.step_s, "compute_s": self.time.compute_s,
             "exposed_comm_s": self.time.exposed_comm_s, "comm_bytes_per_layer": self.time.comm_bytes_per_layer,
             "step_time_parts_s": dict(self.time.parts),
             "dummy_heads": self.dummy_heads, "kv_replication": self.kv_replication, "seq_len": self.seq_len,
             "sequences_per_step": self.sequences, "tokens_per_s": self.tokens_per_s,
             "host_bytes_per_gpu": self.host_bytes, "fits": self.fits}
        if self.capped_by:
            d["capped_by"] = self.capped_by
        if self.max_seq_len is not None:
            d["max_seq_len"] = self.max_seq_len
        return d


def feature_sets(req: Request) -> list[Features]:
    ac = [req.activation_checkpointing] if req.activation_checkpointing is not None else [False, True]
    fsdp = [req.fsdp] if req.fsdp is not None else [False, True]
    out = []
    for a, f in itertools.product(ac, fsdp):
        if req.offload_activations and not a:
            continue  # offload moves the checkpointed layer inputs: it needs checkpointing
        if req.offload_optimizer and not f:
            continue
        out.append(Features(activation_checkpointing=a, offload_activations=req.offload_activations and a,
                            fused_loss=req.fused_loss, tiled_mlp=req.tiled_mlp, tiled_layer=req.tiled_layer, fsdp=f,
                            offload_optimizer=req.offload_optimizer and f, keep_attention=req.keep_attention and a))
    if not out:
        raise SeqParError("--offload-activations needs activation checkpointing and --offload-optimizer needs FSDP: "
                          "drop --no-activation-checkpointing / --no-fsdp")
    return out


def _chunked(f: Features, m: ModelFacts, lay: Layout, req: Request) -> Features:
    """The request's attention head chunks for this mesh ("auto": planner.tiled.auto_head_chunks)."""
    c = req.attention_head_chunks
    c = auto_head_chunks(m, lay.ulysses, req.workload.device) if c == "auto" else int(c)
    return replace(f, attention_head_chunks=c) if c != f.attention_head_chunks else f


def _layouts(m: ModelFacts, cl: Cluster, req: Request) -> list[Layout]:
    u_fix, r_fix = req.ulysses_degree, req.ring_degree
    for name, v in (("--ulysses-degree", u_fix), ("--ring-degree", r_fix)):
        if v is not None:
            check_divides(v, cl.gpus, f"{name} {v} must divide --gpus {cl.gpus}: use one of {{ok}}")
    rec = m.recurrent.ulysses if m.recurrent is not None else None  # hybrids: what their recurrent layers split
    if rec is not None and u_fix is not None and not rec.allows(u_fix):
        raise SeqParError(f"--ulysses-degree {u_fix}: the model's {rec.kind} layers ({rec.heads} heads"
                          + (f" in {rec.groups} groups" if rec.kind == "mamba2" else "") + ") cannot be split by it: "
                          f"use one of {rec.degrees(cl.gpus)} (the rest ring: state passing)")
    out = []
    for sp in divisors(cl.gpus):
        for u in divisors(sp):
            r = sp // u
            if (u_fix is None or u == u_fix) and (r_fix is None or r == r_fix) and (rec is None or rec.allows(u)):
                out.append(Layout(u, r, cl.gpus // sp))
    if not out:
        raise SeqParError(f"no mesh has ulysses={u_fix} x ring={r_fix} dividing --gpus {cl.gpus}: "
                          "their product must divide the GPU count")
    return out


_multiple = split_multiple


def _evaluate(m: ModelFacts, cl: Cluster, wl: Workload, lay: Layout, f: Features) -> Candidate:
    mem = estimate_memory(m, wl, lay, f)
    t = estimate_time(m, wl, lay, f, cl)
    plan = head_plan(m.heads, m.kv_heads, lay.ulysses) if lay.ulysses > 1 else None
    dummy = plan.dummy_heads if plan else 0
    rep = (plan.expanded_kv_heads // m.kv_heads) if plan else 1
    host = host_bytes(m, wl, lay, f)["total"]
    fits = mem.total <= usable_bytes(cl) and (cl.host_mem_bytes is None or host <= cl.host_mem_bytes)
    return Candidate(lay, f, mem, t, fits, dummy, rep, wl.seq_len, host_bytes=host, rows=wl.rows)


def _longest(m: ModelFacts, cl: Cluster, wl: Workload, lay: Layout, f: Features, ctx: Context) -> Candidate:
    """The longest multiple of the mesh's split that fits (memory grows with the length), at most the
    model's context limit."""
    step = _multiple(lay)
    top = (ctx.limit // step) if ctx.limit is not None else 2**40 // step
    lo, hi = 0, 1
    while hi <= top and _evaluate(m, cl, replace(wl, seq_len=hi * step), lay, f).fits:
        lo, hi = hi, hi * 2
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _evaluate(m, cl, replace(wl, seq_len=mid * step), lay, f).fits else (lo, mid)
    c = _evaluate(m, cl, replace(wl, seq_len=max(lo, 1) * step), lay, f)
    c.max_seq_len = lo * step
    c.fits = lo > 0
    if lo > 0 and lo == top:
        c.capped_by = ctx.reason
    return c


TIE = 0.02  # throughputs within 2% of the best comparable candidate are a tie (the model's error is larger)


def _intra_ulysses(c: Candidate, cl: Cluster) -> int:
    """Tie-break: the largest ulysses degree that stays inside a node (one all-to-all on NVLink beats
    r ring steps of smaller, less efficient attention blocks)."""
    return c.layout.ulysses if c.layout.ulysses <= cl.gpus_per_node and c.dummy_heads == 0 else 0


def _meshes(m: ModelFacts, cl: Cluster, req: Request, ctx: Context, notes: list[str]) -> list[tuple[Layout, int]]:
    """(mesh, the length it runs) for a fixed --seq-len: a length a mesh cannot split is padded to its
    multiple (the collator pads; dataset.max_length is that multiple), unless that passes the context limit."""
    wl, out, dropped, pads = req.workload, [], [], {}
    for lay in _layouts(m, cl, req):
        n = padded(wl.seq_len, lay)
        if ctx.limit is not None and n > ctx.limit:
            dropped.append(f"u{lay.ulysses}r{lay.ring}d{lay.dp} (needs {n})")
            continue
        if n != wl.seq_len:
            pads.setdefault(n, []).append(f"u{lay.ulysses}r{lay.ring}")
        out.append((lay, n))
    for n, which in sorted(pads.items()):
        notes.append(f"--seq-len {wl.seq_len} is not a multiple of what {', '.join(sorted(set(which)))} split "
                     f"(ulysses x ring, x2 for the zigzag ring): those rows run at {n} tokens, padding included "
                     f"(seqpar's collator pads; dataset.max_length: {n})")
    if dropped:
        notes.append(f"dropped meshes whose padded length passes {ctx.limit} ({ctx.reason}): {', '.join(dropped)}")
    if not out:
        raise SeqParError(f"--seq-len {wl.seq_len} cannot run on any mesh asked for: padded to each mesh's split it "
                          f"passes {ctx.limit} ({ctx.reason}); use a shorter --seq-len")
    return out


def _rank(cands: list[Candidate], cl: Cluster, max_len: bool) -> None:
    """Fitting candidates by training tokens per second over the cluster (a dp = 2 row processes twice the
    sequences of a dp = 1 row per step, so step times alone do not compare them); with --max-seq-len the
    longest first. Throughputs within TIE of the best of their group are a tie, broken by the ulysses
    degree that stays inside a node."""
    best: dict[Any, float] = {}
    group = (lambda c: c.max_seq_len) if max_len else (lambda c: None)  # noqa: E731
    for c in cands:
        if c.fits:
            best[group(c)] = max(best.get(group(c), 0.0), c.tokens_per_s)

    def speed(c: Candidate) -> float:  # 0 for the tied-best, else the shortfall in time per token
        return 0.0 if c.tokens_per_s >= best[group(c)] / (1 + TIE) else 1.0 / max(c.tokens_per_s, 1e-30)

    if max_len:
        cands.sort(key=lambda c: (not c.fits, -(c.max_seq_len or 0), speed(c) if c.fits else 0.0,
                                  -_intra_ulysses(c, cl)))
    else:
        cands.sort(key=lambda c: (not c.fits, speed(c) if c.fits else c.memory.total, -_intra_ulysses(c, cl),
                                  -c.tokens_per_s, c.memory.total))


# What is not validated of a hybrid plan (docs/planner.md, "Hybrid models"): said with every plan of one.
HYBRID_NOTE = ("hybrid model: the recurrent layers' memory is counted from transformers' torch paths of the chunked "
               "delta rule / Mamba2 SSD scan / selective scan / short conv / lightning attention / RG-LRU scan "
               "(validated on CPU against the meter: docs/planner.md); with the flash-linear-attention, mamba_ssm or "
               "causal-conv1d GPU kernels installed their working sets differ and are not validated: read "
               "peak_alloc_mb of a short seqpar train run before a long one")


# LoRA on a hybrid: its savings are not modelled (docs/planner.md, "Hybrid models"): said with every such plan.
HYBRID_LORA_NOTE = ("--finetuning lora on a hybrid model is not modelled: a frozen recurrent mixer with nothing "
                    "trainable before it (an adapter-free first layer) keeps none of the activations this plan counts "
                    "for it, so the memory column over-estimates (2.2x the meter on tiny Qwen3.5; not validated on "
                    "other hybrids): read peak_alloc_mb of a short seqpar train run for the real figure")


def plan(m: ModelFacts, cl: Cluster, req: Request,
         notes: list[str] | None = None) -> tuple[list[Candidate], int | None]:
    """All candidates, best first, and the index of the recommended one (None if nothing fits). `notes`
    (if given) receives what the table alone would not say: padded lengths, dropped meshes, the cap."""
    notes = notes if notes is not None else []
    wl = req.workload
    if not req.max_seq_len and wl.seq_len < 1:
        raise SeqParError(f"--seq-len must be positive, got {wl.seq_len}")
    if usable_bytes(cl) <= 0:
        raise SeqParError(f"--gpu-mem {cl.mem_bytes} bytes leaves nothing after the planner's margin "
                          f"({MARGIN_FRACTION:.0%} + {MARGIN_BYTES / 2**30:.0f} GiB): give the real GPU memory")
    if m.blocks and (req.tiled_mlp or req.tiled_layer):
        raise SeqParError(f"model {m.name!r} holds one mixer or one MLP per block (Nemotron-H): seqpar's tiled MLP / "
                          "tiled layer tile a decoder layer's gated MLP and refuse these blocks at apply time: drop "
                          "--tiled-mlp / --tiled-layer")
    if m.moe is not None and (req.tiled_mlp or req.tiled_layer or wl.lora):
        raise SeqParError(f"model {m.name!r} has mixture-of-experts MLPs: seqpar's tiled MLP / tiled layer refuse them "
                          "at apply time, and LoRA on their experts is not modelled: drop --tiled-mlp / --tiled-layer "
                          "/ --finetuning lora (full fine-tuning is planned)")
    if m.family is not None and (req.tiled_mlp or wl.lora):
        raise SeqParError(f"model {m.name!r} ({m.model_type}): the tiled MLP and LoRA are not modelled for its layers "
                          "(planner.families): drop --tiled-mlp / --finetuning lora (full fine-tuning is planned)")
    if m.recurrent is not None and req.tiled_layer:
        raise SeqParError("--tiled-layer tiles standard decoder layers only, not a hybrid's recurrent layers (seqpar "
                          "refuses it at apply time too): drop it")
    if m.recurrent is not None:
        notes.append(HYBRID_NOTE)
        if wl.lora:
            notes.append(HYBRID_LORA_NOTE)
    ctx = context_limit(m, req.max_position, req.rope_scaling)
    cands = []
    if req.max_seq_len:
        for lay in _layouts(m, cl, req):
            cands += [_longest(m, cl, wl, lay, _chunked(f, m, lay, req), ctx) for f in feature_sets(req)]
        if any(c.capped_by for c in cands):
            notes.append(f"--max-seq-len capped at {ctx.limit}: {ctx.reason}" + (
                "" if ctx.extended else
                "; a context-extended config (--max-position N or --rope-scaling FACTOR) may fit more"))
    else:
        refuse_too_long(ctx, wl.seq_len)
        for lay, n in _meshes(m, cl, req, ctx, notes):
            cands += [_evaluate(m, cl, replace(wl, seq_len=n), lay, _chunked(f, m, lay, req))
                      for f in feature_sets(req)]
    _rank(cands, cl, req.max_seq_len)
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
    if c.host_bytes:
        budget = "" if cl.host_mem_bytes is None else f" of {cl.host_mem_bytes / 2**30:.0f} GiB per GPU (--host-mem)"
        parts.append(f"host memory {c.host_bytes / 2**30:.1f} GiB per GPU{budget} "
                     f"({c.host_bytes * min(cl.gpus_per_node, cl.gpus) / 2**30:.0f} GiB per node)")
    parts.append(f"peak {c.memory.total / 2**30:.1f} GiB at {c.memory.phase} of {usable_bytes(cl) / 2**30:.1f} "
                 f"usable; {c.sequences} sequence(s) of {c.seq_len} per step, {c.tokens_per_s:,.0f} tokens/s over "
                 "the cluster: the highest predicted throughput among those that fit")
    return "; ".join(parts)


def train_yaml(model_name: str, c: Candidate, wl: Workload, seq_len: int, ctx: Context | None = None) -> str:
    """A `seqpar train` config for the candidate, loadable as printed (seqpar.train.config.load_config);
    comment lines say what to fill in: the data, and the model (a hub id, or a local copy of it; for an
    extended context a placeholder directory whose config.json carries the longer positions)."""
    f = c.features
    name, head = model_name, ["# dataset.path: your data (JSONL / JSON / Parquet, see docs/training.md)"]
    if ctx is not None and ctx.extended:
        name = f"/path/to/{model_name.rstrip('/').split('/')[-1]}-{ctx.max_position}"
        rope = (f" and its rope_scaling factor x{ctx.rope_factor:g}" if ctx.rope_factor else "")
        head.append(f"# model.name: a copy of {model_name} whose config.json sets max_position_embeddings: "
                    f"{ctx.max_position}{rope} (seqpar refuses longer rows than the config's positions)")
    else:
        head.append(f"# model.name: {model_name} is a hub id (downloaded on first use; gated models need access), "
                    "or a local directory holding that model")
    cfg: dict[str, Any] = {
        "model": {"name": name},
        "dataset": {"path": "data/train.jsonl", "max_length": seq_len, "packing": wl.stage == "sft"},
        "stage": wl.stage,
        "finetuning": {"method": wl.finetuning},
        "sequence_parallel": {"size": c.layout.sp, "ulysses_degree": c.layout.ulysses,
                              "ring_degree": c.layout.ring,
                              **({"state_passing": wl.state_passing} if wl.state_passing != "chain" else {})},
        "fsdp": {"enabled": f.fsdp, "offload": f.offload_optimizer},
        "memory": {"activation_checkpointing": f.activation_checkpointing,
                   "offload_activations": f.offload_activations, "fused_loss": f.fused_loss,
                   "tiled_mlp": f.tiled_mlp, "tiled_layer": f.tiled_layer,
                   **({"attention_head_chunks": f.attention_head_chunks} if f.attention_head_chunks > 1 else {}),
                   **({"keep_attention": True} if f.keep_attention else {})},
        "precision": wl.precision,
        "micro_batch_size": wl.micro_batch_size,
    }
    if wl.stage == "dpo" or wl.micro_batch_size > 1:
        cfg["dataset"]["packing"] = False
    return "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False)
