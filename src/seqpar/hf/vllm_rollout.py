"""GRPO completions for an SP group from colocated vLLM engines (seqpar.hf.vllm_engine), one per rank.

The same contract as seqpar.hf.generation.generate_for_group: every SP rank samples its `prompt_share` of the
group's prompts, each row seeded by `row_seed` (the same seeds as the transformers engine), and the shares are
all-gathered, so every rank of the group trains identical rows and a completion depends on its seed alone (not on
the SP or dp size). Before sampling every rank pushes the policy's current weights into its engine
(seqpar.hf.weight_stream: FSDP2's gathers are collective, so every rank pushes, in the same order). Any failure
(push, sampling, a dead engine) reaches every rank of the group as the same SeqParError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import SeqParError
from ..mesh import SequenceParallelMesh
from .generation import gather_shares, group_source_rank, local_rows, prompt_share, sequence_parallel_paused
from .weight_stream import named_full_weights

__all__ = ["vllm_generate_for_group"]


def vllm_generate_for_group(
    engine: Callable[[], Any],
    model: torch.nn.Module,
    mesh: SequenceParallelMesh,
    prompt_ids: Sequence[Sequence[int]],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    step: int,
    eos_token_id: int | None,
    prompt_index: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """(completions, the engine's log-probs of their tokens) for this SP group's prompts, prompt-major
    ([p0 g0, p0 g1, ..., p1 g0, ...]), identical on every rank of the group. engine(): this rank's engine
    (seqpar.hf.vllm_engine.VLLMEngine), started on the first call: a failure to start is reported like any other."""
    share = prompt_share(len(prompt_ids), mesh.sp_size, mesh.sp_rank)
    rows, seeds = local_rows(prompt_ids, share, num_generations, seed, step, mesh.dp_rank, prompt_index)
    result: Any = []
    try:
        eng = engine()
        with sequence_parallel_paused(model):  # names and shapes of the plain model (nothing SP is a weight)
            eng.push(named_full_weights(model))
        if rows:
            ids, lps = eng.generate(rows, seeds, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k, eos_token_id=eos_token_id)
            result = list(zip(ids, lps))
    except Exception as e:  # travels to the group's other ranks, which would otherwise wait forever
        first = (str(e).strip().splitlines() or [""])[0][:300]
        result = SeqParError(f"vLLM rollout failed on rank {group_source_rank(mesh) + mesh.sp_rank}: "
                             f"{type(e).__name__}: {first}")
    return gather_shares(result, mesh)
