"""Checks of a run's configuration that need more than the YAML: the world size, the model's head
counts, the dataset's size. They read files but never touch torch.distributed, so a bad config fails
on every rank with the same message before the first collective.

GRPO reward modules ("module:function") are imported here too, so `seqpar check`, `seqpar train` (every
launch mode) and `seqpar verify` fail on a missing module before anything starts. They are looked up on
sys.path plus the config file's folder and the working directory (`add_reward_search_path`, called by the
CLI; exported through PYTHONPATH, so the ranks torchrun starts and verify's SP run see the same folders).
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import SeqParError
from ...layout import required_multiple, round_up_length
from ...mesh import RecurrentHeads, auto_degrees, check_divides, divisors, resolve_degrees
from .schema import SequenceParallelSpec, TrainConfig

__all__ = ["resolve_sp_degrees", "dynamic_degrees", "rows_sp_size",
           "validate_for_launch", "steps_for_epochs", "with_total_steps", "rows_per_step",
           "resolve_grad_accum", "import_reward", "check_reward_funcs", "add_reward_search_path"]


def resolve_sp_degrees(sp: SequenceParallelSpec, num_heads: int | None, num_kv_heads: int | None, *,
                       recurrent: RecurrentHeads | None = None, node_size: int | None = None) -> tuple[int, int]:
    """(ulysses, ring) as seqpar.init_mesh will choose them (recurrent: a hybrid model's recurrent-layer heads;
    node_size: processes per node, which an automatic Ulysses degree divides)."""
    return resolve_degrees(sp.size, sp.ulysses_degree, sp.ring_degree, num_heads, num_kv_heads,
                           recurrent=recurrent, node_size=node_size)


def dynamic_degrees(cfg: TrainConfig, world: int, num_heads: int | None, num_kv_heads: int | None, *,
                    recurrent: RecurrentHeads | None = None,
                    node_size: int | None = None) -> dict[int, tuple[int, int]]:
    """size: dynamic: {degree: (ulysses, ring)} for the degrees dividing the world, up to the one a row of
    dataset.max_length needs (tokens per rank: its padded length x its sequences / d <= max_local_tokens), each
    split as `size: d` would; SeqParError when even the whole world cannot hold such a row."""
    sp = cfg.sequence_parallel
    n, length = sp.max_local_tokens, cfg.dataset.max_length
    seqs = 2 if cfg.stage == "dpo" else 1
    out: dict[int, tuple[int, int]] = {}
    for d in divisors(world):
        u, r = auto_degrees(d, num_heads, num_kv_heads, recurrent=recurrent, node_size=node_size)
        out[d] = (u, r)
        need = seqs * round_up_length(length, r, u, sp.layout) // d
        if need <= n:
            return out
    pair = " x 2 rows (a DPO pair)" if seqs == 2 else ""
    raise SeqParError(
        f"sequence_parallel.max_local_tokens={n} cannot hold a row of dataset.max_length={length} tokens{pair} even "
        f"at the largest degree, the world size {world} ({need} tokens per rank): set max_local_tokens: {need} or "
        f"more, lower max_length, or launch more processes")


def rows_sp_size(cfg: TrainConfig, world: int, num_heads: int | None, num_kv_heads: int | None, *,
                 recurrent: RecurrentHeads | None = None, node_size: int | None = None) -> int:
    """The SP size a step's rows are counted at: the fixed size, or with size: dynamic the largest degree it uses
    (its steps take the rows of the fixed run at that size: dp = world / it)."""
    if not cfg.sequence_parallel.dynamic:
        return cfg.sequence_parallel.size
    return max(dynamic_degrees(cfg, world, num_heads, num_kv_heads, recurrent=recurrent, node_size=node_size))


def validate_for_launch(cfg: TrainConfig, world_size: int, *, num_heads: int | None = None,
                        num_kv_heads: int | None = None, recurrent: RecurrentHeads | None = None,
                        node_size: int | None = None) -> tuple[int, int]:
    """Checks that need the world size and head counts; returns (ulysses, ring) (size: dynamic: of its largest
    degree). No collectives. node_size: processes per node (None: one node holds the world)."""
    if cfg.sequence_parallel.dynamic:
        degrees = dynamic_degrees(cfg, world_size, num_heads, num_kv_heads, recurrent=recurrent, node_size=node_size)
        _common_checks(cfg, world_size // max(degrees))
        return degrees[max(degrees)]
    sp = cfg.sequence_parallel.size
    check_divides(sp, world_size, f"sequence_parallel.size={sp} does not divide the world size {world_size}: set "
                  f"size to one of {{ok}}, or launch a multiple of {sp} processes (--nproc-per-node)")
    u, r = resolve_sp_degrees(cfg.sequence_parallel, num_heads, num_kv_heads, recurrent=recurrent,
                              node_size=node_size)
    if recurrent is not None and not recurrent.allows(u):  # what apply_sequence_parallel refuses after launch
        ok = recurrent.degrees(sp)
        raise SeqParError(
            f"model.name={cfg.model.name!r} has {recurrent.kind} layers with {recurrent.heads} heads"
            + (f" in {recurrent.groups} groups" if recurrent.kind == "mamba2" else "")
            + f", which ulysses_degree={u} cannot split: use a ulysses_degree among {ok} (the rest ring: state "
            f"passing), e.g. sequence_parallel: {{size: {sp}, ulysses_degree: {max(ok)}}}, or leave the degrees unset"
        )
    m = required_multiple(r, u, cfg.sequence_parallel.layout if r > 1 else "contiguous")
    for name, ds in (("dataset", cfg.dataset), ("eval_dataset", cfg.eval_dataset)):
        L = ds.max_length if ds is not None else m
        if L % m != 0:
            lo, hi = (L // m) * m, (L // m + 1) * m
            alts = " or ".join(str(x) for x in (lo, hi) if x > 0)
            raise SeqParError(
                f"{name}.max_length={L} cannot be split evenly over sequence_parallel.size={sp} "
                f"(ulysses={u}, ring={r}, layout={cfg.sequence_parallel.layout}): it must be a multiple of {m}; "
                f"use max_length: {alts}"
            )
    _common_checks(cfg, world_size // sp)
    return u, r


def _common_checks(cfg: TrainConfig, dp: int) -> None:
    resolve_grad_accum(cfg, dp)  # global_batch_size: a grad_accum must exist at this dp size
    check_reward_funcs(cfg)
    if "tensorboard" in cfg.report_to:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise SeqParError(
                "report_to: tensorboard needs the tensorboard package: pip install tensorboard (or drop report_to)"
            ) from None


def rows_per_step(cfg: TrainConfig, dp_size: int) -> int:
    """The global batch of one optimizer step, in rows of the data stream: dp x micro_batch_size x grad_accum
    examples (packs with packing, where a micro-batch is one pack; prompts for GRPO, whose micro_batch_size x
    grad_accum completion rows per dp rank hold that / num_generations prompts)."""
    per = cfg.grad_accum * (1 if cfg.dataset.packing else cfg.micro_batch_size)
    if cfg.stage == "grpo" and cfg.grpo is not None:
        per //= cfg.grpo.num_generations
    return dp_size * per


def resolve_grad_accum(cfg: TrainConfig, dp_size: int) -> TrainConfig:
    """cfg with grad_accum from global_batch_size for this dp size (unchanged without global_batch_size)."""
    if cfg.global_batch_size is None:
        return cfg
    gbs, mbs = cfg.global_batch_size, (1 if cfg.dataset.packing else cfg.micro_batch_size)
    per = dp_size * mbs
    if gbs % per:
        raise SeqParError(
            f"global_batch_size={gbs} is not a multiple of dp ({dp_size}) x micro_batch_size ({mbs}) = {per}, so no "
            f"grad_accum gives it at this world size: use a multiple of {per} (e.g. {max(per, gbs // per * per)}), "
            f"another micro_batch_size or sequence_parallel.size, or grad_accum instead"
        )
    out = cfg.model_copy(update={"grad_accum": gbs // per})
    g = out.grpo
    if out.stage == "grpo" and g is not None and (mbs * out.grad_accum) % g.num_generations:
        step = dp_size * g.num_generations * mbs // math.gcd(g.num_generations, mbs)
        raise SeqParError(
            f"global_batch_size={gbs} gives each of the {dp_size} dp ranks {mbs * out.grad_accum} completion rows per "
            f"step, which grpo.num_generations={g.num_generations} does not divide (a prompt's completions never "
            f"split over dp ranks): use a multiple of {step}"
        )
    return out


def steps_for_epochs(cfg: TrainConfig, n_examples: int, dp_size: int, start: tuple[int, int] | None = None) -> int:
    """Optimizer steps for cfg.num_epochs passes over n_examples (rows, or packs when packing).

    steps = ceil(num_epochs x n_examples / rows_per_step): the run reads the rows epoch after epoch, a step
    takes the next global batch of them (train/dataset/streams.py). start: (step, rows consumed) of a
    checkpoint being resumed, which a global batch of another size continues: step + the steps the rows left
    need at this layout's batch.
    """
    done_step, done_rows = start or (0, 0)
    left = math.ceil(max(0.0, cfg.num_epochs * n_examples - done_rows) / rows_per_step(cfg, dp_size))
    return done_step + left if start is not None else max(1, left)


def with_total_steps(cfg: TrainConfig, n_examples: int, dp_size: int,
                     start: tuple[int, int] | None = None) -> TrainConfig:
    """cfg for this dp size: grad_accum from global_batch_size, then max_steps from num_epochs (unchanged when
    max_steps was given); start: see steps_for_epochs."""
    cfg = resolve_grad_accum(cfg, dp_size)
    if cfg.num_epochs is None:
        return cfg
    return cfg.model_copy(update={"max_steps": steps_for_epochs(cfg, n_examples, dp_size, start)})


def add_reward_search_path(config_path: str | os.PathLike | None) -> list[str]:
    """Put the config file's folder and the working directory on sys.path (appended: installed packages
    win) and on PYTHONPATH (for child processes); returns the folders added."""
    folders = [str(Path(config_path).resolve().parent)] if config_path is not None else []
    folders.append(os.getcwd())
    added = [f for f in dict.fromkeys(folders) if f not in sys.path]
    sys.path.extend(added)
    env = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    new = [f for f in dict.fromkeys(folders) if f not in env]
    if new:
        os.environ["PYTHONPATH"] = os.pathsep.join(env + new)
    return added


def import_reward(path: str) -> Callable[..., Any]:
    """The function named by "package.module:function" (not a seqpar: built-in); SeqParError naming the fix."""
    mod, name = path.split(":")
    try:
        module = importlib.import_module(mod)
    except SyntaxError as e:  # the module's own code (a bad encoding too): where, and what
        raise SeqParError(f"reward function {path!r}: {e.filename}:{e.lineno}: {type(e).__name__} ({e.msg}): fix "
                          f"the module") from None
    except ModuleNotFoundError as e:
        if e.name is not None and mod != e.name and not mod.startswith(e.name + "."):  # a module it imports
            raise SeqParError(f"reward function {path!r}: importing {mod} failed: {e}: install it, or fix that "
                              f"import") from None
        raise SeqParError(f"reward function {path!r} cannot be imported ({type(e).__name__}: {e}): put {mod}.py "
                          f"next to the config file or in the working directory, or its package on PYTHONPATH") \
            from None
    except Exception as e:  # noqa: BLE001 - whatever the module's top level raised: one line
        first = (str(e).splitlines() or [""])[0][:200]
        raise SeqParError(f"reward function {path!r}: importing {mod} raised {type(e).__name__}: {first}: fix the "
                          f"module") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise SeqParError(f"reward function {path!r} cannot be imported: {mod} ({getattr(module, '__file__', mod)}) "
                          f"has no {name!r}: check the function name") from None
    if not callable(fn):
        raise SeqParError(f"reward function {path!r} is not callable")
    return fn


def check_reward_funcs(cfg: TrainConfig) -> None:
    """Import every non-built-in reward function of a GRPO run (built-ins are checked when resolved)."""
    if cfg.stage != "grpo" or cfg.grpo is None:
        return
    for path in cfg.grpo.reward_funcs:
        if isinstance(path, str) and path.count(":") == 1 and all(path.split(":")) and not path.startswith("seqpar:"):
            import_reward(path)
