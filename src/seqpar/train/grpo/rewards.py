"""GRPO reward functions and group-normalised advantages.

A reward function is named by an import path "package.module:function" (or "seqpar:<name>" for the
built-ins below) and has TRL's signature:

    f(prompts, completions, **columns) -> list[float | None]

prompts / completions: one entry per completion row (a prompt repeats num_generations times).
They are TEXT when the model has a tokenizer that decodes (every HF tokenizer, and the byte
tokenizer of tiny models); `completion_ids` (token ids) is always passed as a keyword too.
columns: every other dataset column of the row's prompt, repeated alike (e.g. "answer").
None means "no reward for this row" (TRL): the weighted sum over functions skips it (nansum; a row
with no reward from any function gets 0) and the per-function metrics use nanmean / nanstd.

Advantages (TRL's GRPO): per prompt, over its num_generations completions,
    scale_rewards "group": A = (r - mean) / (std + 1e-4)   (std: unbiased, as torch.std)
    scale_rewards "none":  A = r - mean
A prompt's completions always live on one dp rank, so no collective is needed here.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import SeqParError

__all__ = ["resolve_reward", "score", "group_advantages", "BUILTIN_REWARDS", "length", "contains", "match_answer"]


# ----------------------------------------------------------------------------- built-in toy rewards
def length(prompts: list, completions: list, completion_ids: list[list[int]] | None = None, **_: Any) -> list[float]:
    """seqpar:length: the completion's length in tokens / 100 (a toy reward for tests and demos)."""
    ids = completion_ids if completion_ids is not None else completions
    return [len(c) / 100.0 for c in ids]


def contains(prompts: list, completions: list, answer: list | None = None, **_: Any) -> list[float | None]:
    """seqpar:contains: 1.0 when the completion text contains the row's "answer" column, else 0.0;
    None for rows without an answer."""
    if answer is None:
        raise SeqParError("seqpar:contains reads the dataset column 'answer': add it to the prompt rows")
    return [None if a is None else float(str(a) in str(c)) for c, a in zip(completions, answer)]


def match_answer(prompts: list, completions: list, answer: list | None = None, **_: Any) -> list[float | None]:
    """seqpar:match_answer: 1.0 when the stripped completion text equals the row's "answer", else 0.0."""
    if answer is None:
        raise SeqParError("seqpar:match_answer reads the dataset column 'answer': add it to the prompt rows")
    return [None if a is None else float(str(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


BUILTIN_REWARDS: dict[str, Callable[..., list]] = {"length": length, "contains": contains,
                                                    "match_answer": match_answer}


def resolve_reward(path: str) -> Callable[..., list]:
    """The function named by "module:function" (or "seqpar:<builtin>"); SeqParError naming the fix."""
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise SeqParError(f"reward function {path!r}: write it as 'package.module:function' (or seqpar:<name>)")
    mod, name = path.split(":")
    if mod == "seqpar":
        if name not in BUILTIN_REWARDS:
            raise SeqParError(f"reward function {path!r}: no such built-in; use one of "
                              f"{', '.join('seqpar:' + k for k in BUILTIN_REWARDS)}")
        return BUILTIN_REWARDS[name]
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise SeqParError(f"reward function {path!r} cannot be imported ({type(e).__name__}: {e}): put the module "
                          f"on PYTHONPATH and check the function name") from None
    if not callable(fn):
        raise SeqParError(f"reward function {path!r} is not callable")
    return fn


def _one(path: str, fn: Callable[..., list], n: int, args: tuple, kwargs: dict) -> list[float]:
    try:
        out = fn(*args, **kwargs)
    except Exception as e:
        raise SeqParError(f"reward function {path!r} raised {type(e).__name__}: {e}") from None
    try:
        vals = list(out)
    except TypeError:
        raise SeqParError(f"reward function {path!r} returned {type(out).__name__}: return a list of "
                          f"{n} floats (or None)") from None
    if len(vals) != n:
        raise SeqParError(f"reward function {path!r} returned {len(vals)} values for {n} completions: "
                          f"return one float (or None) per completion")
    try:
        return [math.nan if v is None else float(v) for v in vals]
    except (TypeError, ValueError):
        raise SeqParError(f"reward function {path!r} returned a non-number: return floats or None") from None


def score(reward_funcs: Sequence[str], weights: Sequence[float] | None, prompts: list, completions: list,
          completion_ids: list[list[int]], columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-function rewards [n, F] with NaN for None, weighted total [n] = nansum over functions)."""
    n = len(completions)
    weights = list(weights) if weights is not None else [1.0] * len(reward_funcs)
    if len(weights) != len(reward_funcs):
        raise SeqParError(f"reward_weights has {len(weights)} entries for {len(reward_funcs)} reward_funcs: "
                          "give one weight per function")
    cols = [_one(p, resolve_reward(p), n, (prompts, completions), {"completion_ids": completion_ids, **columns})
            for p in reward_funcs]
    per_func = torch.tensor(cols, dtype=torch.float64).reshape(len(reward_funcs), n).T
    total = torch.nansum(per_func * torch.tensor(weights, dtype=torch.float64), dim=1)
    return per_func, total


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Advantages of prompt-major rewards [n] (n = prompts x num_generations), normalised per prompt."""
    if rewards.numel() % num_generations:
        raise SeqParError(f"{rewards.numel()} rewards do not form groups of num_generations={num_generations}")
    g = rewards.reshape(-1, num_generations)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        # num_generations == 1: std is NaN (unbiased); TRL then has A = 0 too (r - mean = 0): keep it finite.
        std = g.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(g[:, :1])
        adv = adv / (std + 1e-4)
    elif scale_rewards != "none":
        raise SeqParError(f"scale_rewards={scale_rewards!r}: use 'group' or 'none'")
    return adv.reshape(-1)
