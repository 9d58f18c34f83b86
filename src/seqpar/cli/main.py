"""`seqpar train|verify|check CONFIG`.

    seqpar train cfg.yaml                          # one process (SP=1), or inside torchrun
    torchrun --nproc-per-node 4 -m seqpar train cfg.yaml
    seqpar train cfg.yaml --nproc-per-node 4       # re-launches itself under torch.distributed.run
    seqpar train cfg.yaml --nproc-per-node 8 --nnodes 2 --node-rank R --rdzv-endpoint node0:29500   # each node
    seqpar train cfg.yaml --nproc-per-node 8 --nnodes 1:2 --node-rank R --rdzv-endpoint node0:29500  # elastic
    seqpar verify cfg.yaml --steps 20 --nproc-per-node 4
    seqpar check cfg.yaml --nproc-per-node 4       # validate only
    seqpar plan --model llama-3.1-8b --gpus 8 --seq-len 131072   # predict memory/time, recommend a mesh
    seqpar export runs/x/checkpoint-20 out/ [--merge-lora]   # a checkpoint as an HF model / PEFT adapter

`--set key.sub=value` overrides config keys (value parsed as YAML). Config errors exit with code 2
and a message naming the fix, before any process is spawned or any process group is created.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from typing import Any

import yaml

from ..errors import SeqParError, TrainingDiverged

__all__ = ["main", "build_parser", "ELASTIC_RESTARTS"]

ELASTIC_RESTARTS = 3  # --max-restarts of an elastic launch (--nnodes MIN:MAX) that gives none


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SeqParError(f"--set {item!r}: use --set key.sub=value")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = yaml.safe_load(v)
        except yaml.YAMLError as e:
            problem = (getattr(e, "problem", None) or str(e)).splitlines()[0]
            raise SeqParError(f"--set {item!r}: the value is not valid YAML ({problem}): quote it (--set "
                              f"'{k.strip()}=\"...\"') or fix it") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqpar", description="Exact sequence-parallel SFT / DPO of HF causal LMs")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("config", help="YAML config (see docs/training.md)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set max_steps=5 --set sequence_parallel.size=2")
        sp.add_argument("--nproc-per-node", type=int, default=None,
                        help="number of processes; `train` re-launches itself under torch.distributed.run")

    t = sub.add_parser("train", help="train per the config")
    common(t)
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--output-dir", default=None)
    t.add_argument("--overwrite", action="store_true",
                   help="a fresh start may replace an earlier run's results in output_dir (overwrite_output_dir)")
    t.add_argument("--max-restarts", type=int, default=None,
                   help="torchrun --max-restarts: restart the ranks after a failure, resuming from the last checkpoint "
                        f"(default: 0, or {ELASTIC_RESTARTS} with --nnodes MIN:MAX)")
    t.add_argument("--nnodes", default=None,
                   help="nodes of the run; run `seqpar train` once on each (default: 1, or SLURM's node count); "
                        "MIN:MAX: elastic, goes on after losing nodes down to MIN, on the new world size")
    t.add_argument("--node-rank", type=int, default=None,
                   help="this node's index; 0 is the node --rdzv-endpoint names (default: 0, or SLURM_NODEID)")
    t.add_argument("--rdzv-endpoint", default=None,
                   help="HOST:PORT on node 0 where the nodes meet, the same on every node (default: "
                        "MASTER_ADDR:MASTER_PORT, or SLURM's first node:29500)")
    t.add_argument("--rdzv-id", default=None, help="rendezvous id, the same on every node (default: SLURM's job id, "
                                                    "else one derived from --rdzv-endpoint)")
    t.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                   help="torch's c10d rendezvous settings, e.g. last_call_timeout=10 (how long a restart waits for "
                        "more nodes once MIN are there), keep_alive_interval=2 (docs/training.md)")
    t.add_argument("--emulate-dp", type=int, default=1, help=argparse.SUPPRESS)

    v = sub.add_parser("verify", help="run with SP and with SP=1, overlay the loss curves, report max |dloss|")
    common(v)
    v.add_argument("--steps", type=int, default=20)
    v.add_argument("--output-dir", default=None, help="default: <config output_dir>/verify")
    v.add_argument("--tolerance", type=float, default=None, help="pass bar for max |dloss| (fp32 1e-5, bf16 5e-2)")

    c = sub.add_parser("check", help="validate the config (and dataset) without training")
    common(c)
    for sp in (t, c):
        sp.add_argument("--device-memory", default=None, metavar="BYTES",
                        help="size: dynamic: per-device memory (e.g. 80GiB) the planner checks max_local_tokens "
                             "against (default: the CUDA device's, when there is one)")
    from ..planner.cli import add_plan_parser

    add_plan_parser(sub)

    e = sub.add_parser("export", help="write a checkpoint-N folder as a Hugging Face model / PEFT adapter")
    e.add_argument("checkpoint", help="<output_dir>/checkpoint-<step> of a `seqpar train` run")
    e.add_argument("out", help="a new or empty folder to write, outside any run's output_dir and checkpoint")
    e.add_argument("--merge-lora", action="store_true", help="LoRA runs: also write OUT/merged (adapter merged)")
    e.add_argument("--overwrite", action="store_true",
                   help="OUT may hold an earlier `seqpar export`: replace it (only if it holds nothing else)")
    return p


def _load(args: argparse.Namespace, extra: dict[str, Any] | None = None):
    from ..train.config import load_config
    from ..train.config.checks import add_reward_search_path

    add_reward_search_path(args.config)  # GRPO reward modules: config folder + working directory, every mode

    ov = _overrides(args.set)
    ov.update(extra or {})
    return load_config(args.config, ov)


def _world_for_checks(args: argparse.Namespace, cfg) -> int:
    if _under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return args.nproc_per_node if args.nproc_per_node is not None else 1


def check_dynamic_memory(cfg: Any, world: int, device_memory: str | None, node_size: int | None = None) -> None:
    """size: dynamic: refuse a max_local_tokens the planner's memory model does not fit on this device (its memory
    known: --device-memory, or the CUDA device's), before anything starts."""
    if not cfg.sequence_parallel.dynamic:
        return
    from ..planner.gpus import parse_bytes

    mem = parse_bytes(device_memory) if device_memory is not None else None
    if mem is None:
        import torch

        if not torch.cuda.is_available():
            return
        mem = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory
    from ..planner.dynamic import check_config_memory

    check_config_memory(cfg, world, mem, node_size)


def _cmd_train(args: argparse.Namespace) -> int:
    extra: dict[str, Any] = {}
    if args.max_steps is not None:
        extra["max_steps"] = args.max_steps
    if args.output_dir is not None:
        extra["output_dir"] = args.output_dir
    if args.overwrite:
        extra["overwrite_output_dir"] = True
    cfg = _load(args, extra)
    nodes = None if _under_torchrun() else _nodes(args)
    world = nodes.world if nodes is not None else int(os.environ.get("WORLD_SIZE", "1"))
    check_dynamic_memory(cfg, world, args.device_memory, nodes.nproc_per_node if nodes is not None else None)
    if nodes is not None and nodes.world > 1:
        from ..train.lifecycle.launch import launch, prelaunch_checks

        # dataset, model, resume: exit code 2 before any rank starts; over nodes the output_dir is rank 0's;
        # elastic: every world size the run may restart at
        prelaunch_checks(cfg, nodes.world, node_size=nodes.nproc_per_node, output_dir=not nodes.multi_node,
                         other_worlds=[w for w in nodes.worlds if w != nodes.world])
        passthrough = ["train", args.config] + [f"--set={s}" for s in args.set]
        if args.max_steps is not None:
            passthrough += ["--max-steps", str(args.max_steps)]
        if args.output_dir is not None:
            passthrough += ["--output-dir", args.output_dir]
        if args.overwrite:
            passthrough += ["--overwrite"]
        if args.device_memory is not None:
            passthrough += ["--device-memory", args.device_memory]
        restarts = args.max_restarts if args.max_restarts is not None else (ELASTIC_RESTARTS if nodes.elastic else 0)
        return launch(cfg, nodes, passthrough, restarts)
    from ..train.run import train

    res = train(cfg, emulate_dp=args.emulate_dp)
    if int(os.environ.get("RANK", "0")) == 0 and not res.steps:
        print(f"[seqpar] done: nothing to train (already complete at step {res.resumed_from}); outputs in "
              f"{res.output_dir}", flush=True)
    elif int(os.environ.get("RANK", "0")) == 0:
        last = f"{res.losses[-1]:.6f}" if res.losses else "n/a"
        print(f"[seqpar] done: {len(res.steps)} steps this run, last loss {last}; metrics {res.metrics_path}; "
              f"plot {res.plot_path}", flush=True)
    return 0


def _nodes(args: argparse.Namespace):
    """This node's part of the launch: the command line, filled in from SLURM's variables (lifecycle/nodes.py)."""
    from ..train.lifecycle.nodes import resolve_nodes

    return resolve_nodes(args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id,
                         env=os.environ, rdzv_conf=args.rdzv_conf)


def _cmd_verify(args: argparse.Namespace) -> int:
    if _under_torchrun():
        raise SeqParError("run `seqpar verify` directly (not under torchrun): it launches the SP run itself")
    cfg = _load(args)
    if args.nproc_per_node is None and cfg.sequence_parallel.dynamic:
        raise SeqParError("seqpar verify of sequence_parallel.size: dynamic needs --nproc-per-node N (its world size)")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.sequence_parallel.size
    from ..train.lifecycle.launch import prelaunch_checks

    # verify's own runs never resume: check everything else before launching them.
    prelaunch_checks(cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": False})}),
                     nproc)
    from ..train.verify import verify

    out = args.output_dir or os.path.join(cfg.output_dir, "verify")
    rep = verify(cfg, args.steps, nproc, out, tolerance=args.tolerance)
    status = "PASS" if rep["passed"] else "FAIL"
    print(f"[seqpar verify] {status}: max |dloss| = {rep['max_abs_dloss']:.3e} over {len(rep['steps'])} steps "
          f"(tolerance {rep['tolerance']:.0e}); max rel |dgrad_norm| = {rep['max_rel_dgrad_norm']:.3e} "
          f"(tolerance {rep['grad_norm_tolerance']:.0e}); step-1 gradient {rep['grad_step1_measure']} = "
          f"{rep[rep['grad_step1_measure']]:.3e} (tolerance {rep['grad_step1_tolerance']:.0e}); plot {rep['png']}; "
          f"report {rep['json']}", flush=True)
    return 0 if rep["passed"] else 1


def _cmd_check(args: argparse.Namespace) -> int:
    cfg = _load(args)
    world = _world_for_checks(args, cfg)
    from ..train.lifecycle.launch import prelaunch_checks

    check_dynamic_memory(cfg, world, args.device_memory)
    stats = prelaunch_checks(cfg, world)  # exactly what `train` checks before it starts
    print(f"[seqpar check] OK: {stats['examples']} training examples from {stats['rows']} rows "
          f"({stats['truncated']} truncated, {stats['dropped_unsupervised']} dropped), world={world}, "
          f"{stats['max_steps']} steps")
    plan = stats["resume"]
    if plan is not None:  # what `seqpar train` will do with the checkpoint in output_dir, at this layout
        print(f"[seqpar check] resumes from step {plan.step}: {plan.ckpt}", flush=True)
        for line in plan.lines or ("written at this layout and global batch: it continues as it was",):
            print(f"[seqpar check] {line}", flush=True)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    if _under_torchrun():
        raise SeqParError("run `seqpar export` as one plain process (not under torchrun)")
    from ..train.lifecycle.export import export_checkpoint

    path = export_checkpoint(args.checkpoint, args.out, merge_lora=args.merge_lora, overwrite=args.overwrite)
    print(f"[seqpar export] exported {args.checkpoint} to {path}", flush=True)
    return 0


def _interrupted() -> int:
    """Ctrl-C in a single process or under plain torchrun: one line (rank 0), no traceback."""
    from ..train.lifecycle.launch import INTERRUPTED

    if os.environ.get("RANK", "0") == "0":
        print("seqpar: interrupted (see <output_dir>/latest for the last checkpoint)", file=sys.stderr, flush=True)
    return INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if _under_torchrun() and os.environ.get("SEQPAR_ERROR_DIR"):
        # A rank under `seqpar train --nproc-per-node`: errors go to the launcher, which prints the first once.
        from ..train.lifecycle.launch import INTERRUPTED, report_rank_error

        # Ctrl-C: the launcher prints the one line (and stops the ranks); a rank leaves at once, so the interrupt
        # cannot land in a weakref callback or teardown and print "Exception ignored ..." noise.
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(INTERRUPTED))
        try:
            return _dispatch(args)
        except BaseException as e:  # noqa: BLE001 -- every failure is reported, none printed N times
            return report_rank_error(e)
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return _interrupted()
    except SeqParError as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0" or not _under_torchrun():
            print(f"seqpar: error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingDiverged as e:
        if os.environ.get("RANK", "0") == "0" or not _under_torchrun():
            print(f"seqpar: stopped: {e}", file=sys.stderr, flush=True)
        return 1


# Count arguments: (flag, attribute, least value). argparse takes any int; a 0 or a negative must not slip through
# an `or` into a default (`--nproc-per-node 0` meaning 1) or reach torchrun as an assertion. --nnodes (N or
# MIN:MAX, a string) is read and checked by resolve_nodes.
COUNTS = (("--nproc-per-node", "nproc_per_node", 1), ("--max-steps", "max_steps", 1), ("--steps", "steps", 1),
          ("--max-restarts", "max_restarts", 0), ("--node-rank", "node_rank", 0),
          ("--emulate-dp", "emulate_dp", 1))


def _check_counts(args: argparse.Namespace) -> None:
    """SeqParError for a count below its least value, or a --tolerance that is negative or not finite."""
    for flag, name, least in COUNTS:
        v = getattr(args, name, None)
        if v is not None and v < least:
            raise SeqParError(f"{flag} {v}: give a whole number >= {least}")
    tol = getattr(args, "tolerance", None)
    if tol is not None and not (math.isfinite(tol) and tol >= 0):
        raise SeqParError(f"--tolerance {tol}: give the largest |dloss| that passes, a finite number >= 0 (default: "
                          f"fp32 1e-5, bf16 5e-2)")


def _dispatch(args: argparse.Namespace) -> int:
    _check_counts(args)
    if args.command == "plan":
        return args.func(args)
    return {"train": _cmd_train, "verify": _cmd_verify, "check": _cmd_check,
            "export": _cmd_export}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
