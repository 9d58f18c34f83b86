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

A value that is not a number (a string such as "1.0", a list, ...) stops the step with a SeqParError naming the
function, the completion and the value: nothing is converted. Numbers are int, float, bool, numpy scalars and
one-element tensors.

Policy for non-finite values: a NaN or +-inf returned by a function is an ERROR, never a
silent 0 -- the step stops with a SeqParError naming each offending function and how many NaN / inf it
returned (per step). To skip a row on purpose, return None: Nones are counted per function and step
(metric `rewards/<f>/none`), rows with no reward from any function as `rewards_missing`, and a step on
which every group's rewards are equal (no learning signal: all advantages 0) is flagged by the metric
`rewards_flat_groups` (the fraction of such groups) and a warning on rank 0 (`reward_health`).

Advantages (TRL's GRPO): per prompt, over its num_generations completions,
    scale_rewards "group": A = (r - mean) / (std + 1e-4)   (std: unbiased, as torch.std)
    scale_rewards "none":  A = r - mean
A prompt's completions always live on one dp rank, so no collective is needed here.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import comm
from ...errors import SeqParError
from ..config.checks import import_reward

__all__ = ["resolve_reward", "score", "group_advantages", "reward_health", "BUILTIN_REWARDS", "length", "contains",
           "match_answer"]


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
    return import_reward(path)


def _one(path: str, fn: Callable[..., list], n: int, args: tuple, kwargs: dict) -> list[float | None]:
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
    out = []
    for i, v in enumerate(vals):
        num = _number(v)
        if num is None and v is not None:
            raise SeqParError(f"reward function {path!r} returned {v!r} ({type(v).__name__}) for completion {i}: "
                              f"return numbers (float, int) or None; strings and other values are not converted")
        out.append(num)
    return out


def _number(v: Any) -> float | None:
    """v as a float when it is a number (int, float, bool, a numpy scalar, a one-element tensor), else None."""
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
        return float(v.item())
    return None


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
    _refuse_nonfinite(reward_funcs, cols)
    cols = [[math.nan if v is None else v for v in c] for c in cols]
    per_func = torch.tensor(cols, dtype=torch.float64).reshape(len(reward_funcs), n).T
    total = torch.nansum(per_func * torch.tensor(weights, dtype=torch.float64), dim=1)
    return per_func, total


def _refuse_nonfinite(reward_funcs: Sequence[str], cols: list[list[float | None]]) -> None:
    """NaN / inf from a function stop the step, naming each function and its counts (None is no reward)."""
    bad = []
    for path, vals in zip(reward_funcs, cols):
        nan = sum(1 for v in vals if v is not None and math.isnan(v))
        inf = sum(1 for v in vals if v is not None and math.isinf(v))
        if nan or inf:
            bad.append(f"{path!r} returned {nan} NaN and {inf} inf of {len(vals)} values")
    if bad:
        raise SeqParError(f"non-finite rewards: {'; '.join(bad)}. Return finite floats, or None for a row "
                          "that has no reward (None is skipped like TRL, and counted in rewards/<f>/none)")


def reward_health(per_func: torch.Tensor, total: torch.Tensor, names: Sequence[str], num_generations: int,
                  mesh: Any = None) -> dict[str, float]:
    """Per-step counts summed over dp (one all-reduce on mesh.dp_group when dp > 1; every rank calls it):
    `rewards/<f>/none` (Nones per function), `rewards_missing` (rows with no reward at all),
    `rewards_flat_groups` (fraction of prompts whose completions all got the same total reward: zero
    advantage, no learning signal). Rank 0 warns when every group is flat."""
    g = total.reshape(-1, num_generations)
    flat = float((g.max(dim=1).values - g.min(dim=1).values <= 1e-12).sum())
    none = torch.isnan(per_func)
    sums = [flat, float(g.shape[0]), float(none.all(dim=1).sum()), *[float(c) for c in none.sum(dim=0)]]
    if mesh is not None and mesh.dp_size > 1:
        sums = comm.all_reduce_values(sums, mesh.dp_group, mesh.comm_device).tolist()
    out = {"rewards_flat_groups": sums[0] / max(1.0, sums[1]), "rewards_missing": int(sums[2])}
    out.update({f"rewards/{name}/none": int(c) for name, c in zip(names, sums[3:])})
    if sums[0] == sums[1] and _is_rank0():
        print(f"[seqpar] warning: no learning signal this step: all {int(sums[1])} prompts got equal rewards for "
              f"all their completions (advantages 0; rewards_missing={out['rewards_missing']}). Check the reward "
              f"functions, num_generations, temperature and max_completion_length (clipped completions)",
              file=sys.stderr, flush=True)
    return out


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


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
