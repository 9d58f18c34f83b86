"""`seqpar plan --validate`: predicted vs measured (MemTracker) peak memory on small CPU configurations.

The grid covers what this build can measure: no memory features, full vs LoRA, SFT vs DPO, FSDP on/off,
SP 1/2/4 in ulysses, ring and USP modes, two architectures (Llama; Qwen3 with q/k norms), fp32 and bf16
(fp32 masters), 2 and 8 layers. Feature rows are the same cases with `memory` keys flipped (FEATURE_SETS:
activation checkpointing, fused loss, tiled MLP, activation offload, all four). Offload on CPU keeps the
layer inputs in seqpar.memory.offload's host store (not device bytes) and copies on demand (no prefetch:
Features.offload_prefetch=False). FSDP2 CPU offload cannot be measured on CPU (host and device are one).
The prediction knows each case's unsupervised positions per row (the fused loss computes
logits only for supervised ones): a SFT row's last position, a DPO row's prompt.
`--validate-time` compares the ORDER of predicted step times with measured CPU step times.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, replace
from typing import Any

from .measure import Case, measure_case, unsupervised_tokens
from .memory import Features, Layout, Workload, estimate_memory
from .model import load_model_facts

__all__ = ["GRID", "HYBRID_GRID", "HYBRID_TOLERANCE", "HYBRID_RESULTS",
           "FAST_GRID", "REACH_GRID", "TILED_GRID", "UNTILED_GRID", "HEAD_CHUNK_GRID", "CUDA_GRID", "KEEP_GRID",
           "FEATURE_SETS", "predict_case",
           "run_validation", "format_rows", "with_features", "TOLERANCE", "TIME_GRID", "FAST_TIME_GRID",
           "run_time_validation", "time_ordering", "format_time_rows"]

TOLERANCE = 0.02
NO_FEATURES: dict[str, Any] = {"fused_loss": False}
FEATURE_SETS: dict[str, dict[str, Any]] = {
    "none": NO_FEATURES,
    # Rows for the memory features (`--features ckpt,fused,tiled,all`; `all` alone = every set).
    "ckpt": {"fused_loss": False, "activation_checkpointing": True},
    "fused": {"fused_loss": True},
    "tiled": {"fused_loss": False, "tiled_mlp": True},
    "offload": {"fused_loss": True, "activation_checkpointing": True, "offload_activations": True},
    "all": {"fused_loss": True, "activation_checkpointing": True, "tiled_mlp": True, "offload_activations": True},
    # every feature with the tiled decoder layer, 64-token loss chunks (the layer's backward is the peak)
    "layer": {"fused_loss": True, "activation_checkpointing": True, "tiled_mlp": True, "offload_activations": True,
              "tiled_layer": True, "loss_chunk_tokens": 64},
}
_B = Case(memory=NO_FEATURES)
GRID: list[Case] = [
    _B, replace(_B, seq_len=512), replace(_B, finetuning="lora"), replace(_B, stage="dpo"),
    replace(_B, stage="dpo", finetuning="lora"), replace(_B, arch="qwen3"),
    replace(_B, arch="qwen3", finetuning="lora"),
    replace(_B, ulysses=2), replace(_B, ring=2), replace(_B, ulysses=2, fsdp=True), replace(_B, ring=2, fsdp=True),
    replace(_B, ulysses=4), replace(_B, ring=4), replace(_B, ulysses=2, ring=2),
    replace(_B, num_heads=6, num_kv_heads=2, ulysses=4),  # dummy heads + kv replication
    replace(_B, arch="qwen3", ulysses=2, ring=2, stage="dpo"),
    replace(_B, ulysses=2, dp=2), replace(_B, ring=2, finetuning="lora", fsdp=True),
    replace(_B, ulysses=2, stage="dpo", fsdp=True),  # the frozen reference sharded like the policy
    # bf16 without FSDP: bf16 weights + fp32 masters (seqpar train's MasterWeights); 8 layers x 1024 tokens:
    # layer inputs (what checkpointing keeps and offload moves to the host) are a visible share of the peak
    replace(_B, precision="bf16"), replace(_B, precision="bf16", finetuning="lora"),
    replace(_B, num_layers=8, seq_len=1024), replace(_B, num_layers=8, seq_len=1024, precision="bf16", ulysses=2),
]
# The rows `tests/test_planner_reach.py` measures for offload and bf16 masters (slow).
REACH_GRID: list[Case] = GRID[-4:]
# The tiled decoder layer's rows (`tests/test_planner_reach.py`, slow): 4 layers x 1024 tokens, SP 1 (fp32, bf16
# with fp32 masters, LoRA), ulysses 2, ring 2 (full, LoRA) and USP 2 x 2 (2048 tokens: 512 per rank, as ring 2's):
# the peak is a layer's attention backward.
_L = Case(num_layers=4, seq_len=1024, memory=FEATURE_SETS["layer"])
TILED_GRID: list[Case] = [_L, replace(_L, precision="bf16"), replace(_L, finetuning="lora"), replace(_L, ulysses=2),
                          replace(_L, ring=2), replace(_L, ring=2, finetuning="lora"),
                          replace(_L, ulysses=2, ring=2, seq_len=2048)]
# The first four without the tiled layer (every other feature): the peak is the layer's input-norm backward (bf16,
# LoRA) or attention's backward (fp32, ulysses 2).
UNTILED_GRID: list[Case] = [replace(c, memory={**c.memory, "tiled_layer": False}) for c in TILED_GRID[:4]]
FAST_GRID: list[Case] = [_B, replace(_B, finetuning="lora"), replace(_B, ulysses=2), replace(_B, stage="dpo")]
# Attention in head chunks (memory.attention_head_chunks = 2): SP 1 fp32 / bf16, ulysses 2, ring 2, untiled SP 1.
HEAD_CHUNK_GRID: list[Case] = [replace(c, memory={**c.memory, "attention_head_chunks": 2})
                               for c in (TILED_GRID[0], TILED_GRID[1], TILED_GRID[3], TILED_GRID[4], UNTILED_GRID[0])]
# Rows marked cuda: the CPU kernel holding what CUDA's flash / cuDNN backward allocates (attention kernel
# cpu_cuda_workspace), planned with the planner's CUDA terms (Workload.device = "cuda"); the first four also in
# head chunks.
_CUDA = [replace(c, attention_kernel="cpu_cuda_workspace")
         for c in (*TILED_GRID[:2], TILED_GRID[3], TILED_GRID[4], TILED_GRID[6], UNTILED_GRID[0], UNTILED_GRID[3])]
CUDA_GRID: list[Case] = _CUDA + [replace(c, memory={**c.memory, "attention_head_chunks": 2}) for c in _CUDA[:4]]
# Checkpointing that keeps attention's outputs (memory.keep_attention): SP 1 fp32 / bf16, ulysses 2, ring 2, and
# untiled SP 1 / ulysses 2.
KEEP_GRID: list[Case] = [replace(c, memory={**c.memory, "keep_attention": True}) for c in
                         (TILED_GRID[0], TILED_GRID[1], TILED_GRID[3], TILED_GRID[4], UNTILED_GRID[0], UNTILED_GRID[3])]


# Hybrids (planner.recurrent_memory): tiny Qwen3.5 (Gated DeltaNet), Bamba and Granite 4 with its dense MLP (Mamba2),
# 2 layers (recurrent, then attention), 256 tokens: SP 1, ring 2, ulysses 2, USP 2 x 2 (512 tokens: 128 per rank),
# without memory features and with checkpointing + fused loss; offload at SP 1. Readings committed in
# docs/cpu_results/ (HYBRID_RESULTS, written by `seqpar plan --validate --features hybrid --validate-json PATH`).
HYBRID_TOLERANCE = 0.07
_HYBRIDS = [Case(arch="qwen3_5", head_dim=16), Case(arch="bamba", head_dim=8),
            Case(arch="granitemoehybrid", head_dim=8, model_kwargs={"num_local_experts": 0})]
_MESHES = [{}, {"ring": 2}, {"ulysses": 2}, {"ulysses": 2, "ring": 2, "seq_len": 512}]
HYBRID_GRID: list[Case] = [replace(h, memory=mem, **mesh) for h in _HYBRIDS
                           for mem in (NO_FEATURES, {"fused_loss": True, "activation_checkpointing": True})
                           for mesh in _MESHES] + [replace(h, memory=FEATURE_SETS["offload"]) for h in _HYBRIDS]
# Nemotron-H's blocks (one mixer or one dense MLP each: planner.model's mlp_index): Mamba2, MLP, attention, MLP;
# SP 1, ring 2, ulysses 2, without memory features and with checkpointing + fused loss.
NEMOTRON_H = Case(arch="nemotron_h", head_dim=8, model_kwargs={
    "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"]})
HYBRID_GRID += [replace(NEMOTRON_H, memory=mem, **mesh) for mem in (
    NO_FEATURES, {"fused_loss": True, "activation_checkpointing": True}) for mesh in _MESHES[:3]]
# Qwen3-Next: Gated DeltaNet / gated attention with an MoE MLP in each layer (planner.moe: 4 experts, top-2, a shared
# expert; transformers' grouped_mm experts); SP 1, ring 2, ulysses 2, without memory features and with
# checkpointing + fused loss. Qwen3.5-MoE (the same MoE block, its own text config type) at SP 1. A wider MoE (16
# experts, top-4, expert I 64, shared I 48: the MoE's terms a larger share) at SP 1 and on a ring of 2.
QWEN3_NEXT = Case(arch="qwen3_next", head_dim=16)
_CKPT_FUSED = {"fused_loss": True, "activation_checkpointing": True}
HYBRID_GRID += [replace(QWEN3_NEXT, memory=mem, **mesh) for mem in (NO_FEATURES, _CKPT_FUSED) for mesh in _MESHES[:3]]
HYBRID_GRID += [Case(arch="qwen3_5_moe", head_dim=16, memory=mem) for mem in (NO_FEATURES, _CKPT_FUSED)]
WIDE_MOE = replace(QWEN3_NEXT, model_kwargs={"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64,
                                             "shared_expert_intermediate_size": 48})
HYBRID_GRID += [replace(WIDE_MOE, memory=NO_FEATURES), replace(WIDE_MOE, memory=_CKPT_FUSED),
                replace(WIDE_MOE, memory=_CKPT_FUSED, ring=2)]
HYBRID_RESULTS = "docs/cpu_results/2026-11-27-planner-hybrid.json"
def _ckpt(arch: str) -> dict[str, bool]:
    """Checkpointing + fused loss (Falcon-H1 scales its logits after lm_head: seqpar refuses the fused loss)."""
    return {**_CKPT_FUSED, "fused_loss": False} if arch == "falcon_h1" else _CKPT_FUSED


# The hybrid families of planner.families, one tiny model each (hf.models_hybrid's shapes, head dim 8): SP 1 without
# memory features, a ring of 2 with checkpointing + fused loss (Falcon-H1: without; state passing, the conv halo) and
# Ulysses 2 without features.
# Readings committed in docs/cpu_results/ (FAMILY_RESULTS, `seqpar plan --validate --features families
# --validate-json PATH`).
FAMILY_ARCHS = ("lfm2", "mamba", "falcon_mamba", "jamba", "minimax", "kimi_linear", "falcon_h1", "zamba2",
                "olmo_hybrid", "recurrent_gemma")
FAMILY_GRID: list[Case] = [Case(arch=a, head_dim=8, memory=mem, **mesh) for a in FAMILY_ARCHS
                           for mem, mesh in ((NO_FEATURES, {}), (_ckpt(a), {"ring": 2}), (NO_FEATURES, {"ulysses": 2}))]
FAMILY_RESULTS = "docs/cpu_results/2026-11-29-planner-families.json"


def _features(case: Case) -> Features:
    mem = case.memory
    tiled = mem.get("tiled_mlp", False)
    return Features(activation_checkpointing=bool(mem.get("activation_checkpointing", False)),
                    offload_activations=bool(mem.get("offload_activations", False)),
                    fused_loss=bool(mem.get("fused_loss", True)), tiled_mlp=bool(tiled), fsdp=case.fsdp,
                    tiled_layer=bool(mem.get("tiled_layer", False)),
                    loss_chunk_tokens=mem.get("loss_chunk_tokens"), offload_prefetch=False,  # CPU: no prefetch
                    attention_head_chunks=mem.get("attention_head_chunks", 1),
                    keep_attention=bool(mem.get("keep_attention", False)))


@functools.cache
def _unsupervised(case: Case) -> int:
    """Only the fused loss depends on it (logits for supervised positions only); reading it needs the
    tokenizer, so other cases skip it."""
    return unsupervised_tokens(case) if _features(case).fused_loss else 0


def predict_case(case: Case) -> int:
    """The planner's peak bytes per rank for a validation case."""
    m = model_facts(case)
    wl = Workload(case.seq_len, case.stage, case.finetuning, case.precision, case.micro_batch_size,
                  unsupervised_tokens=_unsupervised(case),
                  device="cuda" if case.attention_kernel == "cpu_cuda_workspace" else "cpu")
    lay = Layout(case.ulysses, case.ring, case.dp)
    return estimate_memory(m, wl, lay, _features(case), optimizer=case.optimizer).total


def with_features(cases: list[Case], names: list[str]) -> list[Case]:
    return [replace(c, memory=FEATURE_SETS[n]) for n in names for c in cases]


def run_validation(cases: list[Case], timeout: float = 600.0) -> list[dict[str, Any]]:
    """Measure each case (one spawned world per case) and compare; rows carry both numbers."""
    from ..spawn import run_distributed

    rows = []
    for case in cases:
        res = run_distributed(measure_case, case.world, asdict(case), timeout=timeout)
        measured = max(r["peak"]["Total"] for r in res)
        pred = predict_case(case)
        rows.append({"case": case.label(), "measured": measured, "predicted": pred,
                     "rel_err": pred / measured - 1.0, "step_s": max(r["step_s"] for r in res), "fields": asdict(case)})
    return rows


def model_facts(case: Case) -> Any:
    return load_model_facts(f"tiny:{case.arch}", {
        "num_heads": case.num_heads, "num_kv_heads": case.num_kv_heads, "head_dim": case.head_dim,
        "num_layers": case.num_layers, "intermediate_size": case.intermediate_size, "vocab_size": case.vocab_size,
        **case.model_kwargs})


def format_rows(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> str:
    lines = [f"{'case':62s} {'measured':>11s} {'predicted':>11s} {'error':>8s}"]
    for r in rows:
        flag = "" if abs(r["rel_err"]) <= tolerance else f"  <-- over {tolerance:.0%}"
        lines.append(f"{r['case']:62s} {r['measured']:11d} {r['predicted']:11d} {r['rel_err']:+8.2%}{flag}")
    worst = max(abs(r["rel_err"]) for r in rows) if rows else 0.0
    lines.append(f"worst |error| {worst:.2%} (target {tolerance:.0%})")
    return "\n".join(lines)


# Time rows: one 2-rank world each (the machine's 2 cores), a tiny model big enough that compute, not
# python overhead, sets the step time; rows differ in work (length, recomputation, LoRA, dp vs SP) and
# in communication (ulysses vs ring, FSDP).
_T = Case(num_heads=8, num_kv_heads=4, head_dim=32, num_layers=4, intermediate_size=768, vocab_size=2048,
          seq_len=2048, ulysses=2, memory=NO_FEATURES)
TIME_GRID: list[Case] = [
    _T, replace(_T, ulysses=1, ring=2), replace(_T, fsdp=True), replace(_T, ulysses=1, ring=2, fsdp=True),
    replace(_T, memory=FEATURE_SETS["ckpt"]), replace(_T, seq_len=4096), replace(_T, finetuning="lora"),
    replace(_T, ulysses=1, dp=2), replace(_T, stage="dpo", seq_len=1024),
]
FAST_TIME_GRID: list[Case] = [_T, replace(_T, memory=FEATURE_SETS["ckpt"]), replace(_T, seq_len=4096)]
TIME_TIE = 0.10  # measured step times closer than this are a tie: CPU timing noise, not a preference


def predict_time(case: Case, cluster: Any) -> Any:
    """The time model's estimate for a validation case on a (measured) cluster, at its achieved rates."""
    from .time import estimate_time

    wl = Workload(case.seq_len, case.stage, case.finetuning, case.precision, case.micro_batch_size)
    return estimate_time(model_facts(case), wl, Layout(case.ulysses, case.ring, case.dp), _features(case),
                         cluster, mfu=1.0)


def run_time_validation(cases: list[Case], timed_steps: int = 5, timeout: float = 900.0) -> list[dict[str, Any]]:
    """Measure this machine (planner.calibrate), then each case's median unmetered step time; rows carry the
    measured and predicted seconds."""
    from ..spawn import run_distributed
    from .calibrate import measure_cluster

    cluster = measure_cluster(2)
    rows = []
    for case in cases:
        res = run_distributed(measure_case, case.world, asdict(case), meter=False, timed_steps=timed_steps,
                              timeout=timeout)
        est = predict_time(case, cluster)
        rows.append({"case": case.label(), "step_s": max(r["step_s"] for r in res), "predicted_s": est.step_s,
                     "parts": est.parts})
    return rows


def time_ordering(rows: list[dict[str, Any]], tie: float = TIME_TIE) -> tuple[int, int, int]:
    """(pairs ordered alike, pairs compared, measured ties skipped): pairs whose measured step times differ
    by less than `tie` (relative) are not compared."""
    same = total = ties = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a, b = rows[i]["step_s"], rows[j]["step_s"]
            if abs(a - b) < tie * min(a, b):
                ties += 1
                continue
            total += 1
            same += (a < b) == (rows[i]["predicted_s"] < rows[j]["predicted_s"])
    return same, total, ties


def format_time_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':62s} {'measured s':>10s} {'predicted s':>11s} {'ratio':>6s}"]
    for r in rows:
        ratio = r["predicted_s"] / r["step_s"]
        lines.append(f"{r['case']:62s} {r['step_s']:10.3f} {r['predicted_s']:11.3f} {ratio:6.2f}")
    same, total, ties = time_ordering(rows)
    lines.append(f"ordering agrees on {same}/{total} pairs ({ties} pairs within {TIME_TIE:.0%} measured: ties, "
                 "not compared); absolute GPU times are a model, only the order is checked here")
    return "\n".join(lines)
