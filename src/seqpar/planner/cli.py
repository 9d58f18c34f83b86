"""`seqpar plan`: arguments, the table, --json, --validate / --validate-time (kept out of cli/main.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import SeqParError
from .spans import Span

__all__ = ["add_plan_parser", "cmd_plan", "attention_lines", "span_pricing"]

GiB = 2**30
LENGTHS_SPAN_NOTE = ("--lengths prices every attention layer as full attention, fixed and length-aware SP alike (the "
                     "model's sliding windows / chunks are priced by the fixed-length plan only, --seq-len)")


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="predict memory / step time of ulysses x ring x dp and memory features; "
                                    "recommend one and print its YAML")
    p.add_argument("--model", default=None, help="bundled name (llama-3.1-8b, qwen2.5-7b, qwen3-32b, smollm2, ...), "
                                                 "tiny:<arch>, a model directory or config.json")
    _cluster_args(p.add_argument_group("cluster"))
    w = p.add_argument_group("workload")
    g = w.add_mutually_exclusive_group()
    g.add_argument("--seq-len", type=int, default=None)
    g.add_argument("--max-seq-len", action="store_true", help="search the longest sequence that fits")
    g.add_argument("--lengths", default=None, metavar="SPEC",
                   help="a dataset's lengths: a histogram 'share:lo-hi,...' (e.g. 0.9:512-4096,0.09:4096-32768,"
                        "0.01:131072) or a file (JSON list, JSONL with input_ids or length, one per line): fixed SP "
                        "vs length-aware SP (size: dynamic), tokens/s, and max_local_tokens")
    w.add_argument("--stage", choices=("sft", "dpo"), default="sft")
    w.add_argument("--finetuning", choices=("full", "lora"), default="full")
    w.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    w.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None)
    w.add_argument("--micro-batch-size", type=int, default=1)
    w.add_argument("--max-position", type=int, default=None,
                   help="an extended context: the max_position_embeddings of the config you will train with "
                        "(default: the model's own; lengths past it are refused or, with --max-seq-len, capped)")
    w.add_argument("--rope-scaling", type=float, default=None,
                   help="an extended context as a RoPE scaling factor on the model's max_position_embeddings")
    w.add_argument("--prompt-len", type=int, default=0,
                   help="tokens per row without a label (a DPO or SFT prompt): the fused loss computes logits "
                        "only for supervised positions; default 0 = all supervised (the upper bound)")
    _lengths_args(w)
    s = p.add_argument_group("restrict the search")
    s.add_argument("--ulysses-degree", type=int, default=None)
    s.add_argument("--ring-degree", type=int, default=None)
    s.add_argument("--no-activation-checkpointing", action="store_true")
    s.add_argument("--activation-checkpointing", action="store_true", help="only candidates with it")
    s.add_argument("--no-fused-loss", action="store_true")
    s.add_argument("--tiled-mlp", action="store_true")
    s.add_argument("--tiled-layer", action="store_true",
                   help="memory.tiled_layer: norms, projections and MLP in sequence tiles (planner.tiled)")
    s.add_argument("--offload-activations", action="store_true")
    s.add_argument("--offload-optimizer", action="store_true")
    s.add_argument("--state-passing", choices=("chain", "scan"), default="chain",
                   help="hybrids under a ring: how the recurrent layers' states travel (docs/hf.md)")
    s.add_argument("--keep-attention", action="store_true",
                   help="memory.keep_attention: checkpointing keeps attention's outputs (no recompute of it)")
    s.add_argument("--attention-head-chunks", default="1",
                   help="memory.attention_head_chunks: N, or auto (the planner picks per mesh: planner.tiled)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="one JSON object: candidates, recommended")
    o.add_argument("--top", type=int, default=12, help="rows of the table")
    v = p.add_argument_group("validation (CPU, spawns gloo worlds)")
    v.add_argument("--validate", action="store_true", help="predicted vs MemTracker-measured peak memory")
    v.add_argument("--features", default="none",
                   help="feature rows for --validate: none | all | ckpt,fused,tiled,offload,layer (layer: also the "
                   "4-layer rows with and without tiled_layer), chunks (attention head chunks), cuda (rows marked "
                   "cuda: CUDA's attention workspace held by the CPU kernel, planned with the CUDA terms), keep "
                   "(memory.keep_attention), hybrid (Qwen3.5 / Bamba / Granite 4 / Nemotron-H / Qwen3-Next), families "
                   "(LFM2, Mamba, Falcon-Mamba, Jamba, MiniMax, Kimi-Linear, Falcon-H1, Zamba2, OLMo-hybrid; 7%%)")
    v.add_argument("--validate-json", metavar="PATH", help="--validate: also write the rows (case fields, measured, "
                   "predicted) to this JSON file (docs/cpu_results/)")
    v.add_argument("--validate-time", action="store_true", help="predicted vs measured step-time ordering")
    p.set_defaults(func=cmd_plan)


def _lengths_args(w: Any) -> None:
    w.add_argument("--max-local-tokens", type=int, default=None,
                   help="--lengths: size: dynamic's tokens per rank (default: the best the memory model fits)")
    w.add_argument("--rows-per-step", type=int, default=64, help="--lengths: rows per optimizer step (global batch)")
    w.add_argument("--sample-rows", type=int, default=1024, help="--lengths histogram: rows drawn from it")


def _cluster_args(c: Any) -> None:
    c.add_argument("--gpus", type=int, default=8)
    c.add_argument("--gpus-per-node", type=int, default=None)
    c.add_argument("--gpu", default=None, help="preset: a100-80g | h100 | h200 (default h100 numbers)")
    c.add_argument("--gpu-mem", default=None, help="per-GPU memory, e.g. 80GiB")
    c.add_argument("--host-mem", default=None, help="host RAM per GPU for offloaded tensors, e.g. 256GiB, or none "
                                                     "(default: a DGX node's RAM less 10%%, shared by the GPUs the "
                                                     "job uses on it: 2 TiB for h100/h200, 1 TiB for a100-80g)")
    c.add_argument("--intra-bw", type=float, default=None, help="GB/s per GPU inside a node")
    c.add_argument("--inter-bw", type=float, default=None, help="GB/s per GPU across nodes")
    c.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 TFLOP/s per GPU")


def _request(args: argparse.Namespace) -> Any:
    from .memory import Workload
    from .search import Request

    if args.micro_batch_size < 1:
        raise SeqParError(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if not args.max_seq_len and args.seq_len is None and args.lengths is None:
        raise SeqParError("give --seq-len N, --max-seq-len or --lengths SPEC")
    if args.seq_len is not None and args.seq_len < 1:
        raise SeqParError(f"--seq-len must be a number of tokens >= 1, got {args.seq_len}")
    if args.top < 1:
        raise SeqParError(f"--top must be >= 1 (rows of the table), got {args.top}")
    if args.prompt_len < 0 or (args.seq_len is not None and args.prompt_len >= args.seq_len):
        raise SeqParError(f"--prompt-len must be >= 0 and shorter than --seq-len, got {args.prompt_len}")
    ac = False if args.no_activation_checkpointing else (True if args.activation_checkpointing else None)
    return Request(
        workload=Workload(args.seq_len or 0, args.stage, args.finetuning, args.precision, args.micro_batch_size,
                          unsupervised_tokens=args.prompt_len, state_passing=args.state_passing),
        ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree, activation_checkpointing=ac,
        fused_loss=not args.no_fused_loss, tiled_mlp=args.tiled_mlp, tiled_layer=args.tiled_layer,
        offload_activations=args.offload_activations,
        offload_optimizer=args.offload_optimizer, fsdp=args.fsdp, max_seq_len=args.max_seq_len,
        max_position=args.max_position, rope_scaling=args.rope_scaling,
        attention_head_chunks=_head_chunks(args.attention_head_chunks), keep_attention=args.keep_attention)


def _head_chunks(value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise SeqParError(f"--attention-head-chunks must be auto or an int >= 1, got {value!r}")
    return int(value)


def _table(cands: list[Any], top: int, max_len: bool) -> str:
    head = (f"{'#':>2} {'u':>3} {'r':>3} {'dp':>3} {'ckpt':>4} {'fsdp':>4} {'dummy':>5} "
            f"{'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'loss':>7} {'comm':>6} {'temp':>6} {'total':>7} "
            f"{'GB/lay':>7} {'comp s':>8} {'comm s':>8} {'step s':>8} {'seqs':>4} {'ktok/s':>7} {'host':>6} {'fits':>4}"
            + ("   max_seq" if max_len else ""))
    out = [head + "   (memory GiB per GPU; seqs: sequences per step over all dp replicas; host: offloaded GiB/GPU)"]
    for i, c in enumerate(cands[:top]):
        m = c.memory.as_dict()
        parts = ("parameters", "gradients", "optimizer_state", "activations", "loss_chunk")
        gib = [f"{m[k] / GiB:7.1f}" for k in parts]
        gib += [f"{m[k] / GiB:6.1f}" for k in ("comm_buffers", "temp")]
        row = (f"{i:>2} {c.layout.ulysses:>3} {c.layout.ring:>3} {c.layout.dp:>3} "
               f"{'y' if c.features.activation_checkpointing else 'n':>4} {'y' if c.features.fsdp else 'n':>4} "
               f"{c.dummy_heads:>5} {' '.join(gib)} {m['total'] / GiB:7.1f} "
               f"{c.time.comm_bytes_per_layer / 1e9:7.2f} "
               f"{c.time.compute_s:8.2f} {c.time.exposed_comm_s:8.2f} {c.time.step_s:8.2f} "
               f"{c.sequences:>4} {c.tokens_per_s / 1e3:7.1f} {c.host_bytes / GiB:6.1f} {'yes' if c.fits else 'no':>4}")
        out.append(row + (f"   {c.max_seq_len:>8}" if max_len else ""))
    if len(cands) > top:
        out.append(f"... {len(cands) - top} more (--top N, or --json)")
    return "\n".join(out)


def _validate(args: argparse.Namespace) -> int:
    from . import validate as v

    extra = {"layer": v.TILED_GRID + v.UNTILED_GRID, "chunks": v.HEAD_CHUNK_GRID, "cuda": v.CUDA_GRID,
             "keep": v.KEEP_GRID, "hybrid": v.HYBRID_GRID, "families": v.FAMILY_GRID}
    names = list(v.FEATURE_SETS) if args.features == "all" else args.features.split(",")
    bad = [n for n in names if n not in v.FEATURE_SETS and n not in extra]
    if bad:
        raise SeqParError(f"--features {args.features!r}: unknown {bad}; use none, all or "
                          f"{','.join([*v.FEATURE_SETS, *extra])}")
    grid = v.with_features(v.GRID, [n for n in names if n in v.FEATURE_SETS])
    rows = v.run_validation(grid + [c for n in names if n in extra for c in extra[n]])
    tol = v.HYBRID_TOLERANCE if names in (["hybrid"], ["families"]) else v.TOLERANCE
    print(v.format_rows(rows, tol))
    if args.validate_json:
        import json
        import platform

        import torch

        with open(args.validate_json, "w") as fh:
            json.dump({"command": "seqpar plan --validate --features " + args.features, "torch": torch.__version__,
                       "machine": platform.machine(), "tolerance": tol, "rows": rows}, fh, indent=1)
            fh.write("\n")
    return 0 if all(abs(r["rel_err"]) <= tol for r in rows) else 1


def _validate_time() -> int:
    from .validate import TIME_GRID, format_time_rows, run_time_validation, time_ordering

    rows = run_time_validation(TIME_GRID)
    print(format_time_rows(rows))
    same, total, _ = time_ordering(rows)
    return 0 if same == total else 1


def cmd_plan(args: argparse.Namespace) -> int:
    if args.validate or args.validate_time:
        rc = _validate(args) if args.validate else 0
        return max(rc, _validate_time() if args.validate_time else 0)
    if args.model is None:
        raise SeqParError("give --model (e.g. --model llama-3.1-8b, tiny:llama, or a config.json)")
    from .gpus import make_cluster
    from .kind_lines import layer_kind_lines, layer_kind_rows
    from .limits import context_limit
    from .model import load_model_facts, trainable_name
    from .search import plan, train_yaml, usable_bytes, why

    m = load_model_facts(args.model)
    cl = make_cluster(args.gpus, args.gpus_per_node, args.gpu, args.gpu_mem, args.intra_bw, args.inter_bw,
                      args.peak_tflops, args.host_mem)
    req = _request(args)
    if args.lengths is not None:
        return _plan_lengths(args, m, cl, req)
    notes: list[str] = []
    cands, rec = plan(m, cl, req, notes)
    if args.tiled_layer:
        notes.append("--tiled-layer: validated on CPU against the meter (4-layer rows: SP 1, ulysses 2, ring 2, "
                     "USP 2 x 2; 2-layer rows with DPO, LoRA, FSDP: within 2%; docs/planner.md)")
    if args.json:
        print(json.dumps({"model": args.model, "gpus": cl.gpus, "usable_bytes_per_gpu": usable_bytes(cl),
                          "notes": notes, "candidates": [c.as_json() for c in cands], "recommended": rec,
                          "attention_spans": span_pricing(m, req.workload, cands[rec or 0]) if cands else [],
                          "layer_kinds": layer_kind_rows(m, req.workload, cands[rec or 0]) if cands else []},
                         indent=1))
        return 0
    print(f"{args.model}: {m.num_params() / 1e9:.2f}B params, {m.layers} layers, hidden {m.hidden}, "
          f"{m.heads} q / {m.kv_heads} kv heads x {m.head_dim}, vocab {m.vocab}; {cl.gpus} x {cl.name} "
          f"({cl.mem_bytes / GiB:.0f} GiB, {usable_bytes(cl) / GiB:.1f} usable), {cl.gpus_per_node} per node")
    print(_table(cands, args.top, args.max_seq_len))
    for n in notes:
        print(f"note: {n}")
    if cands:
        best_or_first = cands[rec if rec is not None else 0]
        for line in attention_lines(m, req.workload, best_or_first) + layer_kind_lines(m, req.workload, best_or_first):
            print(line)
    if rec is None:
        print("\nnothing fits: add GPUs, use LoRA, --offload-optimizer/--offload-activations, or a shorter sequence")
        return 1
    best = cands[rec]
    seq = best.max_seq_len if args.max_seq_len else best.seq_len
    print(f"\nrecommended #{rec}: {why(m, cl, best)}")
    ctx = context_limit(m, req.max_position, req.rope_scaling)
    print(f"\n# seqpar train config (launch {cl.gpus} processes):\n"
          + train_yaml(trainable_name(args.model), best, req.workload, seq, ctx))
    return 0


def span_pricing(m: Any, wl: Any, cand: Any) -> list[dict[str, Any]]:
    """Per attention span at a candidate's length and mesh: its layers, one layer's forward attention FLOPs on the
    busiest rank and the ring steps that compute anything (the rest are skipped; K/V still rotate the whole ring)."""
    from dataclasses import replace

    from .spans import steps_with_work
    from .time import attention_by_span

    lay, seq = cand.layout, cand.seq_len
    return [{"span": s.kind, "size": s.size, "layers": n, "fwd_flops_per_layer": f,
             "ring_steps_with_work": steps_with_work(seq, lay.ring, "zigzag", s) if lay.ring > 1 else 1}
            for s, (n, f) in attention_by_span(m, replace(wl, seq_len=seq), lay).items()]


def attention_lines(m: Any, wl: Any, cand: Any) -> list[str]:
    """How a model with windows, chunks, MLA or sinks is priced, at a candidate's length and mesh (span_pricing)."""
    groups = m.attention_spans()
    if set(groups) == {Span()} and m.mla is None and not m.sinks:
        return []
    lay, out = cand.layout, []
    if any(s.kind != "full" for s in groups):
        counts = ", ".join(f"{n} {s.describe()}" for s, n in sorted(groups.items(), key=lambda g: -g[1]))
        out.append(f"attention: {counts} layers; at {cand.seq_len} tokens on ulysses {lay.ulysses} x ring {lay.ring} "
                   "(busiest rank, forward, per layer):")
        for p in span_pricing(m, wl, cand):
            steps = f", ring steps with work {p['ring_steps_with_work']} of {lay.ring}" if lay.ring > 1 else ""
            name = Span(p["span"], p["size"]).describe()
            out.append(f"  {name:>24}: {p['layers']:>3} layers x {p['fwd_flops_per_layer'] / 1e12:9.3f} TFLOP{steps}")
        if lay.ring > 1:
            out.append("  (a windowed layer skips the compute of ring steps out of reach; its K/V still travel the "
                       "whole ring: priced as full attention's)")
    if m.mla is not None:
        out.append(f"attention: MLA, q/k head dim {m.head_dim}, v head dim {m.v_head} (padded to {m.head_dim} for the "
                   f"kernels and exchanges), kv_lora_rank {m.mla.kv_lora_rank}, q_lora_rank {m.mla.q_lora_rank}")
    if m.sinks:
        out.append(f"attention: sinks, one logit per q head ({m.heads} per layer; no FLOPs or bytes worth pricing)")
    return out


def _plan_lengths(args: argparse.Namespace, m: Any, cl: Any, req: Any) -> int:
    """--lengths: the fixed layout for the longest row vs size: dynamic over the dataset's rows."""
    from .lengths import parse_lengths, plan_mix

    if args.rows_per_step < 1 or (args.max_local_tokens is not None and args.max_local_tokens < 1):
        raise SeqParError("--rows-per-step and --max-local-tokens must be >= 1")
    lengths = parse_lengths(args.lengths, rows=max(1, args.sample_rows))
    res = plan_mix(m, cl, req, lengths, args.max_local_tokens, args.rows_per_step)
    if any(s.kind != "full" for s in m.attention_spans()):
        res["notes"] = res.get("notes", []) + [LENGTHS_SPAN_NOTE]
    if args.json:
        print(json.dumps({"model": args.model, "gpus": cl.gpus, "gpu": cl.name, "lengths": args.lengths, **res},
                         indent=1))
        return 0
    tps, fx = res["tokens_per_s"], res["fixed_layout"]
    print(f"{args.model} on {cl.gpus} x {cl.name}: {res['rows']} rows (longest {res['longest']}), "
          f"{res['rows_per_step']} per step, {res['steps']} steps")
    print(f"  fixed SP (ulysses {fx['ulysses']} x ring {fx['ring']} x dp {fx['dp']}), one row per micro-batch: "
          f"{tps['fixed'] / 1e3:8.1f} ktok/s")
    if "fixed_packed" in tps:
        print(f"  the same, rows packed to the longest (dataset.packing):            {tps['fixed_packed'] / 1e3:8.1f} "
              "ktok/s")
    print(f"  size: dynamic, max_local_tokens {res['max_local_tokens']}:                        "
          f"{tps['dynamic'] / 1e3:8.1f} ktok/s   x{res['speedup_vs_fixed']:.2f}"
          + (f" (x{res['speedup_vs_fixed_packed']:.2f} vs packed)" if res["speedup_vs_fixed_packed"] else ""))
    print(f"  rows per degree: {res['sp_degrees']}; the memory model fits up to {res['memory_max_local_tokens']} "
          f"tokens per rank with {', '.join(k for k, v in res['dynamic_features'].items() if v) or 'no features'}")
    for n in res.get("notes", []):
        print(f"note: {n}")
    print(f"\n# seqpar train config (launch {cl.gpus} processes):\nsequence_parallel: {{size: dynamic, "
          f"max_local_tokens: {res['max_local_tokens']}}}")
    return 0
