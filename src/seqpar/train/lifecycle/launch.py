"""`seqpar train|verify --nproc-per-node N [--nnodes M ...]`: checks before launch, the launch, one clear outcome.

Before any rank starts, the launching process runs every check that can fail on input (`prelaunch_checks`:
config x world size, model refusals, dataset, token ids vs vocab, max_length vs positions, resume rules)
and takes the output_dir lock; a failure exits with code 2 and one message. Over several nodes (nodes.py)
each node's launcher runs the input checks, but the output_dir checks and the lock are rank 0's, after the
process group (process.take_lock): the nodes may not share the folder, and rank 0's node is the
rendezvous's choice.

The ranks run under torch.distributed's elastic agent IN this process (`torch.distributed.launcher.api.
elastic_launch`, configured as `torchrun --standalone` would be), so this process sees the outcome as
Python exceptions instead of torchrun's logs. Each rank reports an uncaught error into a file
(SEQPAR_ERROR_DIR, see `report_rank_error`) instead of printing a traceback; when the run fails, the
FIRST error is printed once here. Ctrl-C (SIGINT) stops every rank and prints one line with the last
checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from ...errors import SeqParError, TrainingDiverged
from ..config import TrainConfig, validate_for_launch
from .nodes import NodeLaunch

__all__ = ["prelaunch_checks", "launch", "report_rank_error", "ERROR_DIR_ENV", "exit_code"]

ERROR_DIR_ENV = "SEQPAR_ERROR_DIR"
INTERRUPTED = 130  # the shell's code for "stopped by SIGINT"


def prelaunch_checks(cfg: TrainConfig, world: int, node_size: int | None = None, output_dir: bool = True,
                     other_worlds: list[int] | None = None) -> dict[str, Any]:
    """Every input check of `seqpar train`, without weights or processes; returns the dataset stats, and under
    "resume" the ResumePlan (None: a fresh start; not checked without output_dir).
    node_size: processes per node (None: one node); output_dir: also the resume / overwrite rules; other_worlds:
    the world sizes an elastic run may restart at (config x world size checked for each)."""
    from ..config import rows_sp_size, with_total_steps
    from ..dataset.identity import data_identity, export_file_hash
    from ..dataset.prepare import prepare_examples
    from ..grpo.engine import check_rollout_engine
    from ..model.checks import check_model, refuse_unsupported_model
    from ..model.load import load_tokenizer, model_info
    from .resume import check_output_dir, resume_start
    from .run_layout import RunLayout

    info = model_info(cfg)  # the model's config, read once for every check below
    nh, nkv = info.heads
    u, r = validate_for_launch(cfg, world, num_heads=nh, num_kv_heads=nkv, recurrent=info.recurrent,
                               node_size=node_size)
    for w in other_worlds or ():
        try:
            validate_for_launch(cfg, w, num_heads=nh, num_kv_heads=nkv, recurrent=info.recurrent,
                                node_size=node_size)
        except SeqParError as e:
            raise SeqParError(f"this elastic run may restart at world size {w} after losing nodes, and there: {e}") \
                from None
    refuse_unsupported_model(cfg, info)  # before the tokenizer: "not a causal LM" is the message that helps
    sp = rows_sp_size(cfg, world, nh, nkv, recurrent=info.recurrent, node_size=node_size)
    check_rollout_engine(cfg, info.config, sp)  # engine: vllm: installed, the architecture, head_dim, TP sizes
    tok = load_tokenizer(cfg)
    examples, stats = prepare_examples(cfg, tok, info=info)
    evals = prepare_examples(cfg, tok, cfg.eval_dataset, info)[0] if cfg.eval_dataset is not None else []
    check_model(cfg, examples + evals, info)  # the eval rows' errors are input errors too
    n, plan = len(examples), None
    cfg = with_total_steps(cfg, n, world // sp, start=resume_start(cfg, n))
    if output_dir:
        plan = check_output_dir(cfg, RunLayout.of(cfg, world, u, r, sp=sp), data_identity(cfg.dataset.path, examples))
    export_file_hash(cfg.dataset.path)  # read once here (per node), not again by each rank
    return {**stats, "examples": n, "resume": plan, "max_steps": cfg.max_steps}


def exit_code(e: BaseException) -> int:
    if isinstance(e, SeqParError):
        return 2
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED
    return 1


def report_rank_error(e: BaseException) -> int:
    """Under `launch`: write this rank's error for the launcher (no traceback on the console); the exit code."""
    folder = os.environ.get(ERROR_DIR_ENV)
    code = exit_code(e)
    if folder:
        rank = int(os.environ.get("RANK", "0"))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        rec = {"rank": rank, "attempt": attempt, "time": time.time(), "type": type(e).__name__, "message": str(e),
               "code": code, "traceback": "".join(traceback.format_exception(e))}
        path = Path(folder) / f"attempt{attempt}_rank{rank}.json"
        path.write_text(json.dumps(rec))
    return code


def _errors(folder: Path) -> list[dict[str, Any]]:
    """The error records of the last attempt (torchrun restarts start new attempts)."""
    recs = [json.loads(p.read_text()) for p in folder.glob("attempt*_rank*.json")]
    last = max((r["attempt"] for r in recs), default=0)
    return [r for r in recs if r["attempt"] == last]


def _quiet_elastic() -> None:
    # The agent logs every worker failure with tracebacks; the outcome is reported once, below.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _elastic_config(nodes: NodeLaunch, max_restarts: int, run_id: str) -> tuple[Any, Any, list[str]]:
    from torch.distributed.run import config_from_args, get_args_parser

    return config_from_args(get_args_parser().parse_args(nodes.torchrun_args(max_restarts, run_id)))


def launch(cfg: TrainConfig, nodes: NodeLaunch | int, seqpar_args: list[str], max_restarts: int = 0) -> int:
    """Run `python -m seqpar <seqpar_args>` on this node's ranks (an int: that many, one node); returns the exit
    code to use. Over several nodes the lock is rank 0's (module docstring): this launcher only names the run
    (SEQPAR_RUN_ID), so rank 0 locks in the name of its own node's launcher."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from .checkpoint import latest_checkpoint
    from .lock import RUN_ID_ENV, OutputDirLock

    nodes = NodeLaunch(nodes) if isinstance(nodes, int) else nodes
    run_id = uuid.uuid4().hex
    lock = OutputDirLock(cfg.output_dir, run_id=run_id, pid=os.getpid())
    if nodes.multi_node:
        print(f"[seqpar] launching {nodes.describe()}", flush=True)
    else:
        lock.acquire()
    errors = Path(tempfile.mkdtemp(prefix="seqpar_errors_"))
    env_before = dict(os.environ)
    os.environ.update({RUN_ID_ENV: run_id, "SEQPAR_LAUNCHER_PID": str(os.getpid()), ERROR_DIR_ENV: str(errors),
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    try:
        config, cmd, cmd_args = _elastic_config(nodes, max_restarts, run_id)
        _quiet_elastic()  # after the imports above created the loggers
        elastic_launch(config, cmd)(*cmd_args, *seqpar_args)
        shutil.rmtree(errors, ignore_errors=True)
        return 0
    except (SignalException, KeyboardInterrupt):
        ckpt = latest_checkpoint(cfg.output_dir)
        print(f"seqpar: interrupted; last checkpoint: {ckpt if ckpt is not None else 'none (nothing saved yet)'}",
              file=sys.stderr, flush=True)
        return INTERRUPTED
    except ChildFailedError as e:
        return _report_failure(e, errors)
    except RendezvousError as e:  # a node that never came, or a rendezvous closed by a failed node
        print(f"seqpar: error: the rendezvous of {nodes.describe()} failed ({type(e).__name__}: {e}): start "
              f"`seqpar train` on every node with the same --nnodes, --rdzv-endpoint and --rdzv-id",
              file=sys.stderr, flush=True)
        return 1
    finally:
        os.environ.clear()
        os.environ.update(env_before)
        lock.release()


def _report_failure(e: Any, errors: Path) -> int:
    recs = _errors(errors)
    reported = {r["rank"] for r in recs}
    silent = sorted(r for r in e.failures if r not in reported)
    if silent:
        # A killed rank (OOM killer, signal, os._exit) leaves no error; the others then fail in a collective.
        codes = ", ".join(f"rank {r}: exit code {e.failures[r].exitcode}" for r in silent)
        first_type = min(recs, key=lambda r: r["time"])["type"] if recs else ""
        after = f"; then {len(recs)} rank(s) failed, first with {first_type}" if recs else ""
        print(f"seqpar: error: died without a Python error (killed, out of memory, or crashed): {codes}{after}",
              file=sys.stderr, flush=True)
        return 1
    if not recs:
        print("seqpar: error: the run failed (see the output above)", file=sys.stderr, flush=True)
        return 1
    # A KeyboardInterrupt or a peer's "connection closed" follows the root cause: the earliest error wins.
    first = min(recs, key=lambda r: r["time"])
    if first["code"] == 2:
        print(f"seqpar: error: {first['message']}", file=sys.stderr, flush=True)
    elif first["type"] == TrainingDiverged.__name__:
        print(f"seqpar: stopped: {first['message']}", file=sys.stderr, flush=True)
    else:
        tb = errors / f"rank{first['rank']}_traceback.txt"
        tb.write_text(first["traceback"])
        # A message may span many lines (DCP's CheckpointException holds every rank's traceback): its first line
        # here, all of it in the file.
        lines = first["message"].splitlines() or [""]
        more = f" (+{len(lines) - 1} more lines in the traceback file)" if len(lines) > 1 else ""
        print(f"seqpar: error on rank {first['rank']}: {first['type']}: {lines[0][:300]}{more}\n"
              f"seqpar: its traceback: {tb}", file=sys.stderr, flush=True)
    return int(first["code"])
