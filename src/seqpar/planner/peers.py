"""Peers' published long-context numbers as planner workloads (docs/planner.md, "Side by side").

Each anchor is one published run: model, GPUs, the peer's feature set mapped onto seqpar's (DeepSpeed
ZeRO-3 -> FSDP2, its CPU optimizer offload -> fsdp.offload, checkpoint offload -> offload_activations,
tiled / chunked loss -> fused_loss, TiledMLP -> tiled_mlp), and what was published: a maximum length, or
the memory per GPU at a length. `python -m seqpar.planner.peers` prints seqpar's prediction for each, with
that feature set and with all of seqpar's features.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .gpus import make_cluster
from .memory import Workload
from .model import load_model_facts
from .search import Request, plan

__all__ = ["Anchor", "ANCHORS", "predict"]

EXTENDED = 2**25  # the peers' million-token runs extend the context (RoPE scaling): no positional cap here


@dataclass(frozen=True)
class Anchor:
    peer: str
    model: str
    gpus: int
    gpu: str
    published: str  # as published
    value: float  # tokens (max_len) or GiB per GPU (mem_at)
    kind: str  # "max_len" | "mem_at"
    request: Request
    seq_len: int = 0  # mem_at: the length


def _req(stage: str = "sft", ft: str = "full", *, fused: bool = True, tiled: bool = False, act: bool = False,
         opt: bool = False, u: int | None = None, r: int | None = None, mb: int = 1,
         targets: tuple[str, ...] | None = None, fsdp: bool = True) -> Request:
    wl = Workload(0, stage, ft, "bf16", mb)
    if targets:
        wl = replace(wl, lora_targets=targets)
    return Request(wl, ulysses_degree=u, ring_degree=r, activation_checkpointing=True, fused_loss=fused,
                   tiled_mlp=tiled, offload_activations=act, offload_optimizer=opt, fsdp=fsdp, max_seq_len=True,
                   max_position=EXTENDED)


_ALST = dict(fused=True, tiled=True, act=True, opt=True)
_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ANCHORS: list[Anchor] = [
    Anchor("ALST", "llama-3.1-8b", 1, "h100", "500K", 500_000, "max_len", _req(**_ALST)),
    Anchor("ALST", "llama-3.1-8b", 8, "h100", "3.7M", 3_700_000, "max_len", _req(**_ALST)),
    Anchor("ALST", "llama-3.1-8b", 32, "h100", "15M", 15_000_000, "max_len", _req(**_ALST)),
    Anchor("ALST ablation: tiled loss", "llama-3.1-8b", 8, "h100", "1.1M", 1_100_000, "max_len", _req(opt=True)),
    Anchor("ALST ablation: + TiledMLP", "llama-3.1-8b", 8, "h100", "1.2M", 1_200_000, "max_len",
           _req(tiled=True, opt=True)),
    Anchor("ALST ablation: + act. offload", "llama-3.1-8b", 8, "h100", "2.4M", 2_400_000, "max_len",
           _req(act=True, opt=True)),
    Anchor("TRL CP (ring 8)", "qwen3-8b", 8, "h100", "1M at 56 GB/GPU", 56e9 / 2**30, "mem_at",
           _req(act=True, r=8), seq_len=1_048_576),
    Anchor("HF Ulysses blog", "qwen3-4b", 4, "h100", "96K at 66 GB/GPU", 66e9 / 2**30, "mem_at",
           _req(fused=False, u=4), seq_len=98_304),
    Anchor("HF Ulysses blog", "qwen3-4b", 4, "h100", "128K: OOM", 131_072, "max_len", _req(fused=False, u=4)),
    Anchor("360-LF SFT (ring 8)", "qwen2.5-7b", 8, "a100-80g", "210K", 210_000, "max_len",
           _req(fused=False, opt=True, r=8)),
    Anchor("360-LF SFT (ring 8)", "qwen2.5-14b", 8, "a100-80g", "175K", 175_000, "max_len",
           _req(fused=False, opt=True, r=8)),
    Anchor("360-LF SFT (ring 8, dp 4)", "qwen2.5-72b", 32, "a100-80g", "128K", 128_000, "max_len",
           _req(fused=False, opt=True, r=8)),
    Anchor("360-LF DPO (ring 8)", "qwen2.5-7b", 8, "a100-80g", "84K", 84_000, "max_len",
           _req("dpo", fused=False, opt=True, r=8)),
    Anchor("360-LF DPO (ring 8)", "qwen2.5-14b", 8, "a100-80g", "72K", 72_000, "max_len",
           _req("dpo", fused=False, opt=True, r=8)),
    Anchor("360-LF DPO (ring 16, dp 2)", "qwen2.5-72b", 32, "a100-80g", "86K", 86_000, "max_len",
           _req("dpo", fused=False, opt=True, r=16)),
    # ms-swift's example: max_length 64K never binds (LongAlpaca-12k rows are <= 25,826 tokens); padding_free packs
    # the micro-batch of 4 into one row (<= 103,304 tokens); 2 kv heads -> ulysses 2 x ring 4; its chunked CE
    # still materialises the fp32 logits (no fused loss); 40 GiB is torch's max_memory_reserved over the run
    Anchor("ms-swift LoRA (ulysses 2 x ring 4)", "qwen2.5-3b", 8, "a100-80g", "40 GiB/GPU reserved", 40.0, "mem_at",
           _req("sft", "lora", u=2, r=4, fused=False, targets=_ALL_LINEAR, fsdp=False), seq_len=103_304),
]


def _with_all(req: Request) -> Request:
    return replace(req, fused_loss=True, tiled_mlp=True, tiled_layer=True, offload_activations=True, fsdp=True,
                   offload_optimizer=True, ulysses_degree=None, ring_degree=None, attention_head_chunks="auto")


def predict(a: Anchor, everything: bool = False) -> float:
    """seqpar's number for the anchor: the longest length (tokens) or the peak GiB per GPU at its length;
    the peer's feature set, or all of seqpar's (`everything`, any mesh)."""
    m = load_model_facts(a.model)
    cl = make_cluster(a.gpus, None, a.gpu)
    req = _with_all(a.request) if everything else a.request
    if a.kind == "mem_at":
        req = replace(req, max_seq_len=False, workload=replace(req.workload, seq_len=a.seq_len))
    cands, _ = plan(m, cl, req)
    if not everything:  # the peer's own mesh: its SP degree (all GPUs when it names none), the rest data-parallel
        fixed = (req.ulysses_degree or 1) * (req.ring_degree or 1)
        dp = a.gpus // fixed if req.ulysses_degree or req.ring_degree else 1
        cands = [c for c in cands if c.layout.dp == dp] or cands
    if a.kind == "mem_at":
        return min(c.memory.total for c in cands) / 2**30
    return float(max(c.max_seq_len or 0 for c in cands if c.fits) if any(c.fits for c in cands) else 0)


def table() -> str:
    rows = ["| peer | model | GPUs | published | seqpar, same features | ratio | seqpar, all features |",
            "|---|---|---|---|---|---|---|"]
    for a in ANCHORS:
        same, every = predict(a), predict(a, True)
        fmt = (lambda v: f"{v:.1f} GiB") if a.kind == "mem_at" else (lambda v: f"{v / 1e3:,.0f}K")  # noqa: E731
        rows.append(f"| {a.peer} | {a.model} | {a.gpus} x {a.gpu} | {a.published} | {fmt(same)} | "
                    f"{same / a.value:.2f} | {fmt(every)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
