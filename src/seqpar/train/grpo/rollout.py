"""`stage: grpo` for the plain loop: prompts -> completions -> rewards -> SP micro-batches.

Per optimizer step and dp rank: micro_batch_size x grad_accum completion rows = that many /
num_generations prompts (a prompt's completions never split over dp ranks). Every rank of an SP
group samples a share of the group's prompts and the completions are all-gathered
(seqpar.hf.generation.generate_for_group; with FSDP2 every rank joins every generation forward); the
group's first rank scores them (grpo/rewards.py) and broadcasts, so every rank of a group builds the
same rows; any failure (generation or a reward
function) is agreed over dp and raised as the same SeqParError on every rank before the step's
first training collective. Rows are prompt + completion with only completion tokens supervised,
collated by seqpar.data.SequenceParallelCollator (the same padding, sharding and position_ids as
SFT; seqpar.data.VisionCollator for a vision-language model, whose prompts' images / videos go to the rollout's
generate() and with every completion row into the loss), each micro-batch carrying "advantages" [B] for
`micro_batch_loss` stage "grpo".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ... import comm
from ...data import SequenceParallelCollator
from ...errors import SeqParError
from ...hf.generation import group_source_rank
from ...hf.vllm_rollout import placed_rollout_logps
from ...loss import ImportanceSampling
from ...mesh import SequenceParallelMesh
from ...steps import StepSpec
from ..config import TrainConfig
from ..dataset.prompts import PromptRow
from ..dataset.tokenize import IGNORE
from .engine import RolloutEngine, write_rollouts
from .rewards import group_advantages, reward_health, score

__all__ = ["GRPORollout", "grpo_step_spec"]


def grpo_step_spec(cfg: TrainConfig) -> StepSpec:
    """The StepSpec of stage "grpo" (seqpar.steps)."""
    g = cfg.grpo
    return StepSpec(stage="grpo", beta=g.beta, loss_type=g.loss_type, fused_loss=cfg.memory.fused_loss,
                    loss_chunk_tokens=cfg.memory.loss_chunk_tokens, epsilon_low=g.epsilon,
                    epsilon_high=g.epsilon_high, max_completion_length=g.max_completion_length,
                    kl_ratio_correction=g.kl_ratio_correction, temperature=g.temperature,
                    importance=_importance(g.importance_correction, g.importance_min, g.importance_cap),
                    keep_old_logps=g.num_iterations > 1)


def _importance(mode: str, clip_min: float | None, clip_max: float | None) -> ImportanceSampling | None:
    """grpo.importance_correction as seqpar.loss.importance's spec ("tis" = "token_truncate"; "none": None)."""
    if mode == "none":
        return None
    return ImportanceSampling.from_name("token_truncate" if mode == "tis" else mode, clip_min, clip_max)


def _texts(tok: Any, rows: list[PromptRow], completions: list[list[int]], g: int) -> tuple[list, list]:
    """TRL's reward inputs: prompts as given; completions as text, or [{"role": "assistant", ...}]
    for chat prompts. Ids only (no decode) for a tokenizer without decode."""
    prompts = [r.prompt for r in rows for _ in range(g)]
    if not hasattr(tok, "decode"):
        return prompts, completions
    eos = tok.eos_token_id
    texts = [tok.decode([t for t in c if t != eos]) for c in completions]
    conv = [r.conversational for r in rows for _ in range(g)]
    return prompts, [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, conv)]


class GRPORollout:
    """Builds one step's GRPO micro-batches for this rank (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, mesh: SequenceParallelMesh, tok: Any, prompts: list[PromptRow],
                 collator: SequenceParallelCollator) -> None:
        self.cfg, self.mesh, self.tok, self.prompts, self.collator = cfg, mesh, tok, prompts, collator
        self.g = cfg.grpo
        self.engine = RolloutEngine(cfg, mesh, tok)
        self.logprobs: list[list[float]] = []  # the last rollout's: the engine's log-prob of each sampled token
        self.rollouts_path = Path(cfg.output_dir) / "rollouts.jsonl" if self.g.log_rollouts else None
        self.held: tuple[int, Any] | None = None  # (the step it was sampled at, the rollout's batches / rows)

    def reused(self, step: int, make: Any) -> tuple[Any, dict[str, float]]:
        """num_iterations: `make()` (a rollout: (batches or rows, metrics)) at steps 0, n, 2n, ...; the steps between
        reuse it (its batches keep their old log-probs: StepSpec.keep_old_logps). Returns it and the step's metrics
        (the rollout's, with grpo_iteration: 1..n when n > 1)."""
        n = self.g.num_iterations
        if step % n == 0 or self.held is None:
            if step % n:  # a resume refuses such a checkpoint (lifecycle/resume.py): nothing else starts here
                raise SeqParError(f"step {step + 1} is pass {step % n + 1} of a rollout (grpo.num_iterations={n}) "
                                  "that this process did not sample: resume from a checkpoint at a multiple of "
                                  "num_iterations")
            self.held = (step, make())
        data, metrics = self.held[1]
        return data, {**metrics, **({"grpo_iteration": step % n + 1} if n > 1 else {})}

    def _score(self, rows: list[PromptRow], completions: list[list[int]]) -> Any:
        """(per_func [n, F], total [n]) or the SeqParError, computed on the group's first rank."""
        if self.mesh.sp_rank != 0:
            return None
        try:
            prompts, texts = _texts(self.tok, rows, completions, self.g.num_generations)
            names = {k for r in rows for k in r.columns}
            cols = {k: [r.columns.get(k) for r in rows for _ in range(self.g.num_generations)] for k in names}
            return score(self.g.reward_funcs, self.g.reward_weights, prompts, texts, completions, cols)
        except SeqParError as e:
            return e

    def _agree(self, err: Exception | None) -> None:
        """Every rank raises the same error when any SP group failed (first failing dp rank's message)."""
        m = self.mesh
        if m.dp_size > 1:
            first = comm.all_reduce_values([m.dp_rank if err is not None else m.dp_size], m.dp_group,
                                           m.comm_device, op=dist.ReduceOp.MIN).tolist()[0]
            if int(first) < m.dp_size:
                err = comm.broadcast_object(err, int(first) * m.sp_size, m.comm_device)
        if err is not None:
            raise SeqParError(str(err))

    def rollout(self, model: torch.nn.Module, rows: list[PromptRow], step: int) -> tuple[list, torch.Tensor, Any]:
        """(completions, advantages [n], per-function rewards [n, F]) for `rows`, identical on the SP group.
        Row j of this dp rank is row dp_rank + dp_size x j of the step's global batch (train/dataset/streams.py):
        its samples are seeded by that position, so they are the same at any dp size."""
        g, err, completions, scored = self.g, None, None, None
        m = self.mesh
        index = [m.dp_rank + m.dp_size * j for j in range(len(rows))]
        try:
            completions, self.logprobs = self.engine.generate(
                model, [r.prompt_ids for r in rows], step, index,
                [r.media for r in rows] if any(r.media for r in rows) else None)
        except SeqParError as e:
            err = e
        if err is None:
            scored = self._score(rows, completions)
            if self.mesh.sp_size > 1:
                scored = comm.broadcast_object(scored, group_source_rank(self.mesh), self.mesh.comm_device,
                                               group=self.mesh.sp_group)
            err = scored if isinstance(scored, Exception) else None
        self._agree(err)
        per_func, total = scored
        advantages = group_advantages(total, g.num_generations, g.scale_rewards)
        if self.rollouts_path is not None:
            n_gen = g.num_generations
            write_rollouts(self.rollouts_path, m, [
                {"step": step + 1, "prompt_ids": list(rows[j // n_gen].prompt_ids), "completion_ids": c,
                 "logprobs": lp, "reward": float(total[j]), "advantage": float(advantages[j])}
                for j, (c, lp) in enumerate(zip(completions, self.logprobs))])
        return completions, advantages, (per_func, total)

    def full_rows(self, rows: list[PromptRow], completions: list[list[int]]) -> list[dict[str, Any]]:
        """The training rows: prompt + completion, completion supervised (and the prompt's media)."""
        n_gen = self.g.num_generations
        full = []
        for j, c in enumerate(completions):
            p = rows[j // n_gen].prompt_ids
            full.append({"input_ids": p + c, "labels": [IGNORE] * len(p) + c, **rows[j // n_gen].media})
        return full

    def micro_batches(self, rows: list[PromptRow], completions: list[list[int]], advantages: torch.Tensor,
                      logprobs: list[list[float]] | None = None) -> list[dict[str, torch.Tensor]]:
        """SP micro-batches of micro_batch_size rows each: prompt + completion, completion supervised; with the
        sampler's `logprobs`, "rollout_logps" for the mismatch metrics."""
        mbs = self.cfg.micro_batch_size
        full = self.full_rows(rows, completions)
        out = []
        for s in range(0, len(full), mbs):
            part = full[s:s + mbs]
            b = self.collator(part)
            if logprobs is not None:
                width = b["shift_labels"].shape[1] * self.mesh.sp_size  # the full (padded) length
                lens = [len(rows[j // self.g.num_generations].prompt_ids) for j in range(s, s + len(part))]
                b["rollout_logps"] = placed_rollout_logps(lens, logprobs[s:s + len(part)], width, self.mesh)
            b["advantages"] = advantages[s:s + mbs].to(torch.float32)
            out.append(b)
        return out

    def metrics(self, completions: list[list[int]], scored: Any) -> dict[str, float]:
        """Rewards and completion lengths over the whole step (all dp ranks; SP ranks hold the same)."""
        per_func, total = scored
        eos = self.tok.eos_token_id
        lens = [len(c) for c in completions]
        sums = [float(total.sum()), float((total ** 2).sum()), float(total.numel()), float(sum(lens)),
                float(sum(1 for c in completions if c[:1] == [eos])),
                float(sum(1 for c in completions if eos not in c))]
        for f in range(per_func.shape[1]):
            col = per_func[:, f]
            ok = ~torch.isnan(col)
            sums += [float(col[ok].sum()), float(ok.sum())]
        ext = [float(max(lens)), -float(min(lens))]
        m = self.mesh
        if m.dp_size > 1:
            sums = comm.all_reduce_values(sums, m.dp_group, m.comm_device).tolist()
            ext = comm.all_reduce_values(ext, m.dp_group, m.comm_device, op=dist.ReduceOp.MAX).tolist()
        n = sums[2]
        mean = sums[0] / n
        out = {"reward": mean, "reward_std": math.sqrt(max(0.0, sums[1] / n - mean * mean) * n / max(1.0, n - 1)),
               "completion_length": sums[3] / n, "completion_length_max": ext[0], "completion_length_min": -ext[1],
               "completions_empty": int(sums[4]), "completions_clipped": int(sums[5])}
        for f, name in enumerate(self.g.reward_funcs):
            s, c = sums[6 + 2 * f], sums[7 + 2 * f]
            out[f"rewards/{name}"] = s / c if c else math.nan
        out.update(reward_health(per_func, total, self.g.reward_funcs, self.g.num_generations, m))  # None, flat
        return out

    def step_batches(self, model: torch.nn.Module, stream: Any, step: int) -> tuple[list, dict[str, float]]:
        """One optimizer step: this dp rank's prompts from `stream`, rolled out, collated; plus metrics. With
        num_iterations n, steps k n + 1 .. k n + n - 1 reuse step k n's batches (`reused`)."""
        return self.reused(step, lambda: self._step_batches(model, stream, step))

    def _step_batches(self, model: torch.nn.Module, stream: Any, step: int) -> tuple[list, dict[str, float]]:
        rows = [self.prompts[i] for i in stream.take(self.cfg.micro_batch_size * self.cfg.grad_accum
                                                     // self.g.num_generations)]
        completions, advantages, scored = self.rollout(model, rows, step)
        return self.micro_batches(rows, completions, advantages, self.logprobs), self.metrics(completions, scored)

    def step_rows(self, model: torch.nn.Module, stream: Any, step: int) -> tuple[list[dict], torch.Tensor, dict]:
        """Length-aware SP (train/loop/dynamic_step.py): the step's prompts rolled out as the fixed run at this
        mesh (the largest degree) would -- dp group d takes prompts d, d + dp, ... of the step's block, with its
        seeds and batch shapes -- then every group's completion rows gathered: (rows, advantages [n], metrics),
        the same on every rank. `stream` is the run's one stream (dp 1)."""
        m = self.mesh
        per = self.cfg.micro_batch_size * self.cfg.grad_accum // self.g.num_generations
        idx = stream.take(per * m.dp_size)
        mine = [self.prompts[i] for i in idx[m.dp_rank::m.dp_size]]
        completions, advantages, scored = self.rollout(model, mine, step)
        part = (self.full_rows(mine, completions), advantages.tolist())
        parts = comm.all_gather_object(part, m.dp_group) if m.dp_size > 1 else [part]
        rows = [r for full, _ in parts for r in full]
        adv = torch.tensor([x for _, got in parts for x in got], dtype=torch.float32)
        return rows, adv, self.metrics(completions, scored)
