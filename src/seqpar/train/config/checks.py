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
from ...layout import required_multiple
from ...mesh import check_divides, resolve_degrees
from .schema import SequenceParallelSpec, TrainConfig

__all__ = ["resolve_sp_degrees", "validate_for_launch", "steps_for_epochs", "with_total_steps", "import_reward",
           "check_reward_funcs", "add_reward_search_path"]


def resolve_sp_degrees(sp: SequenceParallelSpec, num_heads: int | None, num_kv_heads: int | None, *,
                       ulysses_only: bool = False, node_size: int | None = None) -> tuple[int, int]:
    """(ulysses, ring) as seqpar.init_mesh will choose them (ulysses_only: models with linear attention;
    node_size: processes per node, which an automatic Ulysses degree divides)."""
    return resolve_degrees(sp.size, sp.ulysses_degree, sp.ring_degree, num_heads, num_kv_heads,
                           ulysses_only=ulysses_only, node_size=node_size)


def validate_for_launch(cfg: TrainConfig, world_size: int, *, num_heads: int | None = None,
                        num_kv_heads: int | None = None, ulysses_only: bool = False,
                        node_size: int | None = None) -> tuple[int, int]:
    """Checks that need the world size and head counts; returns (ulysses, ring). No collectives.
    node_size: processes per node (None: one node holds the world)."""
    sp = cfg.sequence_parallel.size
    check_divides(sp, world_size, f"sequence_parallel.size={sp} does not divide the world size {world_size}: set "
                  f"size to one of {{ok}}, or launch a multiple of {sp} processes (--nproc-per-node)")
    u, r = resolve_sp_degrees(cfg.sequence_parallel, num_heads, num_kv_heads, ulysses_only=ulysses_only,
                              node_size=node_size)
    if ulysses_only and r > 1:  # what apply_sequence_parallel refuses after launch (seqpar.hf.linear_attention)
        raise SeqParError(
            f"model.name={cfg.model.name!r} has linear-attention layers, which need the full sequence on one rank: "
            f"use ring_degree=1 / pure Ulysses (got ulysses={u} x ring={r}; e.g. sequence_parallel: "
            f"{{size: {sp}, ring_degree: 1}})"
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
    check_reward_funcs(cfg)
    if "tensorboard" in cfg.report_to:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise SeqParError(
                "report_to: tensorboard needs the tensorboard package: pip install tensorboard (or drop report_to)"
            ) from None
    return u, r


def steps_for_epochs(cfg: TrainConfig, n_examples: int, dp_size: int) -> int:
    """Optimizer steps for cfg.num_epochs passes over n_examples (rows, or packs when packing).

    steps = ceil(num_epochs x ceil(n_examples / dp_size) / (micro_batch_size x grad_accum)): each dp slot
    sees ceil(n / dp) rows per epoch (the sampler wraps around to even out dp slots) and a step takes
    micro_batch_size x grad_accum of them (a pack counts as one row).
    """
    per_slot = math.ceil(n_examples / dp_size)
    return max(1, math.ceil(cfg.num_epochs * per_slot / (cfg.micro_batch_size * cfg.grad_accum)))


def with_total_steps(cfg: TrainConfig, n_examples: int, dp_size: int) -> TrainConfig:
    """cfg with max_steps filled in from num_epochs (unchanged when max_steps was given)."""
    if cfg.num_epochs is None:
        return cfg
    return cfg.model_copy(update={"max_steps": steps_for_epochs(cfg, n_examples, dp_size)})


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
