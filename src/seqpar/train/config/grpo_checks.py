"""`stage: grpo` rules that involve more than the grpo: section (docs/grpo.md, "Refusals"): read by TrainConfig's
validator (schema.py)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_grpo"]


def check_grpo(cfg: Any) -> None:
    """stage: grpo rules that involve more than the grpo: section (docs/grpo.md, "Refusals")."""
    g = cfg.grpo
    if cfg.stage != "grpo":
        raise ValueError(f"a grpo: section is only read with stage: grpo (stage is {cfg.stage!r}): remove it")
    if g is None:
        raise ValueError("stage: grpo needs a grpo: section with at least reward_funcs: [...] (docs/grpo.md)")
    rows = cfg.micro_batch_size * cfg.grad_accum
    if rows % g.num_generations and cfg.global_batch_size is None:  # else: checked once dp is known (checks.py)
        raise ValueError(
            f"grpo.num_generations={g.num_generations} must divide micro_batch_size x grad_accum = {rows} (the "
            f"completion rows per dp rank and step; a prompt's completions never split over dp ranks): e.g. set "
            f"grad_accum: {g.num_generations // math.gcd(g.num_generations, cfg.micro_batch_size)}"
        )
    if cfg.dataset.packing:
        raise ValueError("dataset.packing is not supported with stage: grpo (one advantage per row): "
                         "set dataset.packing: false")
    need = g.max_prompt_length + g.max_completion_length
    if cfg.dataset.max_length < need:
        raise ValueError(f"dataset.max_length={cfg.dataset.max_length} < grpo.max_prompt_length + "
                         f"grpo.max_completion_length = {need}: set dataset.max_length: {need} or more")
    if cfg.eval_dataset is not None:
        raise ValueError("eval_dataset is not supported with stage: grpo: remove it")
    if cfg.num_epochs is not None:
        raise ValueError("num_epochs is not supported with stage: grpo (steps are counted in prompts): set max_steps")
    n = g.num_iterations
    if n > 1 and cfg.checkpoint.every % n:
        raise ValueError(f"checkpoint.every={cfg.checkpoint.every} must be a multiple of grpo.num_iterations={n}: a "
                         "checkpoint holds no rollout, so it must fall where the next step starts a new one: set "
                         f"checkpoint.every: {cfg.checkpoint.every // n * n or n}")
    if g.importance_correction != "none" and cfg.sequence_parallel.dynamic:
        raise ValueError(f"grpo.importance_correction: {g.importance_correction} is not supported with "
                         "sequence_parallel: {size: dynamic} "
                         "(its slots carry no sampler log-probs): use a fixed size, or importance_correction: none")
