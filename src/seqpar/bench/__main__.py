"""CLI: python -m seqpar.bench attention [--out bench_results/attention.json] [--png FILE] [--quick]
     python -m seqpar.bench attention --peers [all|yunchang|torch_cp] [--out bench_results/attention_peers.json]
                                      [--peer-cases S:P:HQ:HKV[:D],...] [--reps 5] [--quick]
     python -m seqpar.bench memory [--out bench_results/memory.json] [--png FILE] [--quick] [--budget-gib 4]
     python -m seqpar.bench rollout [--out bench_results/rollout.json] [--quick] [--sp 1,2,4]
     python -m seqpar.bench rollout --engines [--out bench_results/rollout_engines.json] [--png FILE] [--quick]
                                    [--models smollm2_135m,tiny] [--repeats 1] [--steps 1] [--sp 2]
                                    (transformers vs vLLM rollouts in GRPO steps: run it with .venv-vllm's python)
     python -m seqpar.bench step [--out bench_results/step.json] [--png FILE] [--quick] [--rounds 2]
     python -m seqpar.bench gpu [--out bench_results/gpu.json] [--parts attention,packed,sp,hybrid,train] [--runs A,B]
                                [--trace RUN] [--quick]   (needs a CUDA GPU: docs/gpu.md)
     python -m seqpar.bench layer-memory [--out bench_results/layer_memory.json] [--lengths 1152,2304]
                                         [--configs A,B] [--quick]
     python -m seqpar.bench recurrent [--out bench_results/recurrent.json] [--seq-len 4096] [--sp 2,4] [--quick]
                                      (hybrid layers: state passing across a ring vs Ulysses)
     python -m seqpar.bench dynamic [--out bench_results/dynamic.json] [--png FILE] [--rounds 3] [--quick]
                                    (length-aware SP vs a fixed size: 4 CPU ranks, and the planner on 8 GPUs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpar.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    _add_attention(sub)
    _add_cpu_benches(sub)
    _add_dynamic(sub)
    _add_gpu(sub)
    args = parser.parse_args(argv)
    other = {"gpu": _gpu, "rollout": _rollout, "step": _step, "memory": _memory, "layer-memory": _layer_memory,
             "recurrent": _recurrent, "dynamic": _dynamic}
    if args.bench in other:
        return other[args.bench](args)

    if args.peers not in ("auto", "deepspeed", "none"):
        return _peers(args)
    from .attention import run
    from .plot import plot_attention, summary_lines

    args.out = args.out or "bench_results/attention.json"
    result = run(quick=args.quick, timeout=args.timeout, peers=args.peers)
    return _report(args, result, summary_lines, plot_attention)


def _add_attention(sub: argparse._SubParsersAction) -> None:
    att = sub.add_parser("attention", help="comm bytes vs theory, causal load balance, SP vs one-process time")
    att.add_argument("--out", default=None,
                     help="JSON output path (default bench_results/attention.json; with --peers: attention_peers.json)")
    att.add_argument("--png", default=None, help="PNG output path (default: next to --out); 'none' to skip")
    att.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, seconds)")
    att.add_argument(
        "--peers", nargs="?", const="all", default="auto",
        help="auto / deepspeed / none: the three-part benchmark with DeepSpeed Ulysses beside it (auto = when "
             "installed); --peers alone (= all), yunchang, torch_cp or a comma list: ONLY the side-by-side part, "
             "seqpar vs yunchang and torch context parallel on the same shards (pip install 'seqpar[peers]')",
    )
    att.add_argument("--peer-cases", default=None, help="side-by-side cases S:P:HQ:HKV[:D],... (P 2 or 4)")
    att.add_argument("--reps", type=int, default=None, help="side-by-side timed repeats (default 5; quick 2)")
    att.add_argument("--timeout", type=float, default=540.0, help="per spawned world, seconds")


def _add_cpu_benches(sub: argparse._SubParsersAction) -> None:
    mem = sub.add_parser("memory", help="exact per-rank peak vs length, SP size and memory features; max length")
    mem.add_argument("--out", default="bench_results/memory.json", help="JSON output path")
    mem.add_argument("--png", default=None, help="PNG output path (default: next to --out); 'none' to skip")
    mem.add_argument("--quick", action="store_true", help="tiny model, 2 lengths (smoke test)")
    mem.add_argument("--budget-gib", type=float, default=4.0, help="per-rank memory budget for the max length")
    mem.add_argument("--models", default=None, help="comma-separated subset: tiny,smollm2")
    mem.add_argument("--timeout", type=float, default=1800.0, help="per spawned world, seconds")
    lay = sub.add_parser("layer-memory", help="per-component bytes per local token of a decoder layer, tiled or not")
    lay.add_argument("--out", default="bench_results/layer_memory.json", help="JSON output path")
    lay.add_argument("--lengths", default="1152,2304", help="two local lengths S1,S2 (the slope between them)")
    lay.add_argument("--configs", default=None, help="comma-separated subset of the feature sets")
    lay.add_argument("--quick", action="store_true", help="2 layers, 128 and 256 tokens (smoke test)")
    stp = sub.add_parser("step", help="tokens/s of one SFT train step at SP=1 vs SP=2 (SmolLM2-135M sizes)")
    stp.add_argument("--out", default="bench_results/step.json", help="JSON output path")
    stp.add_argument("--png", default=None, help="PNG output path (default: next to --out); 'none' to skip")
    stp.add_argument("--quick", action="store_true", help="tiny model, 128 tokens, one round (smoke test)")
    stp.add_argument("--seq-len", type=int, default=None, help="full sequence length (default 1024)")
    stp.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all configurations")
    stp.add_argument("--timeout", type=float, default=3000.0, help="per spawned world, seconds")
    rol = sub.add_parser("rollout", help="GRPO rollout seconds at SP=1/2/4: shared over SP ranks vs rank 0 alone; "
                                         "--engines: transformers vs vLLM (tokens/s, GRPO steps/s)")
    rol.add_argument("--out", default=None,
                     help="JSON output path (default bench_results/rollout.json; --engines: rollout_engines.json)")
    rol.add_argument("--quick", action="store_true", help="tiny model, few tokens (smoke test)")
    rol.add_argument("--sp", default=None, help="comma-separated SP sizes (default 1,2,4); --engines: one (default 2)")
    rol.add_argument("--timeout", type=float, default=1800.0, help="per spawned world, seconds")
    rol.add_argument("--engines", action="store_true",
                     help="transformers' generate() vs the vLLM engine through seqpar train (needs .venv-vllm)")
    rol.add_argument("--png", default=None, help="--engines: PNG path (default: next to --out); 'none' to skip")
    rol.add_argument("--models", default=None, help="--engines: comma-separated subset of smollm2_135m,tiny")
    rol.add_argument("--repeats", type=int, default=1, help="--engines: runs per engine (engine order rotated)")
    rol.add_argument("--steps", type=int, default=1, help="--engines: timed steps per run (after a warm-up step)")
    rec = sub.add_parser("recurrent", help="Gated DeltaNet / Mamba2 layers: ring state passing vs Ulysses at one SP")
    rec.add_argument("--out", default="bench_results/recurrent.json", help="JSON output path")
    rec.add_argument("--quick", action="store_true", help="tiny layers, 64 tokens (smoke test)")
    rec.add_argument("--seq-len", type=int, default=None, help="full sequence length (default 4096)")
    rec.add_argument("--sp", default="2,4", help="comma-separated SP sizes (2 and / or 4)")
    rec.add_argument("--reps", type=int, default=3, help="timed repetitions per point (after one warm-up)")
    rec.add_argument("--timeout", type=float, default=1800.0, help="per spawned world, seconds")


def _peers(args: argparse.Namespace) -> int:
    """`attention --peers`: seqpar vs yunchang and torch context parallel (bench/attention/side_by_side.py)."""
    from ..errors import SeqParError
    from .attention.peer_adapters import yunchang_available
    from .attention.side_by_side import PEERS, parse_cases, run_side_by_side, side_by_side_lines
    from .plot import plot_peers

    peers = PEERS if args.peers == "all" else tuple(args.peers.split(","))
    if any(p not in PEERS for p in peers):
        raise SeqParError(f"--peers {args.peers}: use auto, deepspeed, none, or all / a comma list of {PEERS}")
    if args.peers != "all" and "yunchang" in peers and not yunchang_available():
        raise SeqParError("--peers yunchang: yunchang is not installed; pip install 'seqpar[peers]'")
    args.out = args.out or "bench_results/attention_peers.json"
    cases = parse_cases(args.peer_cases) if args.peer_cases else None
    result = run_side_by_side(peers, quick=args.quick, cases=cases, reps=args.reps,
                              timeout=max(args.timeout, 1800.0))
    return _report(args, result, side_by_side_lines, plot_peers)


def _report(args: argparse.Namespace, result: dict, summary_lines: Callable, plot: Callable | None = None) -> int:
    """Every benchmark's ending: the JSON at --out, the PNG (--png, default next to it; 'none' skips), the summary."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    png = getattr(args, "png", None) or os.path.splitext(args.out)[0] + ".png"
    if plot is not None and png.lower() != "none":
        plot(result, png)
        print(f"wrote {png}")
    print("\n".join(summary_lines(result)))
    return 0


def _memory(args: argparse.Namespace) -> int:
    from .memory import run, summary_lines
    from .plot_memory import plot_memory

    models = args.models.split(",") if args.models else None
    result = run(quick=args.quick, budget_gib=args.budget_gib, timeout=args.timeout, models=models)
    return _report(args, result, summary_lines, plot_memory)


def _layer_memory(args: argparse.Namespace) -> int:
    from .layer_memory import run, summary_lines

    s1, s2 = (int(x) for x in args.lengths.split(","))
    result = run(lengths=(s1, s2), quick=args.quick, configs=args.configs.split(",") if args.configs else None)
    return _report(args, result, summary_lines)


def _step(args: argparse.Namespace) -> int:
    from .plot import plot_step
    from .step import run, summary_lines

    result = run(quick=args.quick, rounds=args.rounds, seq_len=args.seq_len, timeout=args.timeout)
    return _report(args, result, summary_lines, plot_step)


def _add_dynamic(sub: argparse._SubParsersAction) -> None:
    dyn = sub.add_parser("dynamic", help="length-aware SP vs a fixed SP size: tokens/s on 4 CPU ranks, planner on GPUs")
    dyn.add_argument("--out", default="bench_results/dynamic.json", help="JSON output path")
    dyn.add_argument("--png", default=None, help="PNG output path (default: next to --out); 'none' to skip")
    dyn.add_argument("--quick", action="store_true", help="tiny model, one round (smoke test)")
    dyn.add_argument("--rounds", type=int, default=3, help="rounds of the three configurations (medians)")
    dyn.add_argument("--steps", type=int, default=5, help="steps per run (the first is not timed)")
    dyn.add_argument("--timeout", type=float, default=3000.0, help="for the spawned world, seconds")


def _dynamic(args: argparse.Namespace) -> int:
    from .dynamic import plot_dynamic, run, summary_lines

    result = run(quick=args.quick, rounds=args.rounds, steps=args.steps, timeout=args.timeout)
    return _report(args, result, summary_lines, plot_dynamic)


def _add_gpu(sub: argparse._SubParsersAction) -> None:
    gpu = sub.add_parser("gpu", help="one CUDA GPU: kernels vs torch SDPA, packed rows, seqpar train vs plan")
    gpu.add_argument("--out", default="bench_results/gpu.json", help="JSON output path (rewritten after each part)")
    gpu.add_argument("--parts", default="attention,packed,sp,hybrid,train",
                     help="comma-separated: attention,packed,sp,hybrid,train")
    gpu.add_argument("--runs", default=None, help="comma-separated train runs (bench.gpu_train.RUNS), or all")
    gpu.add_argument("--trace", default=None, help="a train run whose live tensors at the peak are listed")
    gpu.add_argument("--quick", action="store_true", help="small sizes and the tiny fp32 runs only")
    gpu.add_argument("--timeout", type=float, default=300.0, help="per train run, seconds")


def _gpu(args: argparse.Namespace) -> int:
    from .gpu import run, summary_lines

    result = run(tuple(args.parts.split(",")), quick=args.quick, runs=args.runs.split(",") if args.runs else None,
                 timeout=args.timeout, trace=args.trace, out=args.out)
    args.png = "none"
    return _report(args, result, summary_lines)


def _recurrent(args: argparse.Namespace) -> int:
    from .recurrent import run, summary_lines

    sp = tuple(int(x) for x in args.sp.split(","))
    if any(p not in (2, 4) for p in sp):
        from ..errors import SeqParError

        raise SeqParError(f"--sp {args.sp}: the recurrent benchmark runs SP sizes 2 and 4")
    result = run(quick=args.quick, seq_len=args.seq_len, reps=args.reps, sp_sizes=sp, timeout=args.timeout)
    args.png = "none"
    return _report(args, result, summary_lines)


def _rollout(args: argparse.Namespace) -> int:
    if args.engines:
        from .rollout_engines import plot_engines, run, summary_lines

        args.out = args.out or "bench_results/rollout_engines.json"
        result = run(quick=args.quick, models=tuple(args.models.split(",")) if args.models else None,
                     repeats=args.repeats, steps=args.steps, sp=int(args.sp or 2), timeout=args.timeout)
        return _report(args, result, summary_lines, plot_engines)
    from .rollout import run, summary_lines  # type: ignore[no-redef]

    args.out = args.out or "bench_results/rollout.json"
    result = run(quick=args.quick, sp_sizes=tuple(int(x) for x in (args.sp or "1,2,4").split(",")),
                 timeout=args.timeout)
    return _report(args, result, summary_lines)


if __name__ == "__main__":
    sys.exit(main())
