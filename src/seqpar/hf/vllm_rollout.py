"""GRPO completions for an SP group from colocated vLLM engines (seqpar.hf.vllm_engine).

The same contract as seqpar.hf.generation.generate_for_group: each row seeded by `row_seed` (the same seeds as the
transformers engine), every rank of the group ends with the group's rows, and a completion depends on its seed
alone (not on the SP or dp size, nor on the engines' tensor-parallel size). Before sampling every rank pushes the
policy's current full weights into its engine (seqpar.hf.weight_stream: FSDP2's gathers are collective, so every
rank pushes, in the same order; with tensor_parallel > 1 vLLM's weight loaders keep each rank's shard of them).

tensor_parallel 1: one engine per rank; every SP rank samples its `prompt_share` and the shares are all-gathered.
tensor_parallel = SP size: one engine per SP group (its TP group); every rank submits all the group's rows, as
vLLM's external launcher wants, and gets them all back; the ranks agree that every engine started and took the
weights before any of them samples (sampling is collective over the TP group), then compare a digest of what they
got, so engines that drifted apart fail loudly instead of training different rows.
Any failure (start, push, sampling, a dead engine) reaches every rank of the group as the same SeqParError; with
tensor_parallel > 1 a failure inside one rank's sampling leaves its TP peers in vLLM's collectives until vLLM's
collective timeout (the run's timeout_minutes), where they fail too: no hang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import comm
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
    eos_token_id: int,
    prompt_index: Sequence[int] | None = None,
    tensor_parallel: int = 1,
) -> tuple[list[list[int]], list[list[float]]]:
    """(completions, the engine's log-probs of their tokens) for this SP group's prompts, prompt-major
    ([p0 g0, p0 g1, ..., p1 g0, ...]), identical on every rank of the group. engine(): this rank's engine
    (seqpar.hf.vllm_engine.VLLMEngine), started on the first call: a failure to start is reported like any other.
    tensor_parallel: 1 or mesh.sp_size (the module docstring)."""
    whole = tensor_parallel > 1
    if whole and tensor_parallel != mesh.sp_size:
        raise SeqParError(f"tensor_parallel={tensor_parallel} must be 1 or the SP size {mesh.sp_size}")
    share = range(len(prompt_ids)) if whole else prompt_share(len(prompt_ids), mesh.sp_size, mesh.sp_rank)
    rows, seeds = local_rows(prompt_ids, share, num_generations, seed, step, mesh.dp_rank, prompt_index)
    result: Any = []
    eng = None
    try:
        eng = engine()
        with sequence_parallel_paused(model):  # names and shapes of the plain model (nothing SP is a weight)
            eng.push(named_full_weights(model))
    except Exception as e:  # travels to the group's other ranks, which would otherwise wait forever
        result = _failure(e, mesh)
    if whole:  # no rank enters the engine's TP collectives unless every rank of the group can
        _agreed(result, mesh)
    try:
        if rows and not isinstance(result, Exception):
            ids, lps = eng.generate(rows, seeds, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_p=top_p, top_k=top_k, eos_token_id=eos_token_id)
            result = list(zip(ids, lps))
    except Exception as e:
        result = _failure(e, mesh)
    if not whole:
        return gather_shares(result, mesh)
    _agreed(result, mesh)
    return [c for c, _ in result], [lp for _, lp in result]


def _failure(e: BaseException, mesh: SequenceParallelMesh) -> SeqParError:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return SeqParError(f"vLLM rollout failed on rank {group_source_rank(mesh) + mesh.sp_rank}: "
                       f"{type(e).__name__}: {first}")


def _agreed(result: Any, mesh: SequenceParallelMesh) -> None:
    """Returns once every rank of the group holds the same `result` (else the first rank's error, or a SeqParError
    naming the disagreement, is raised on every rank)."""
    mine = result if isinstance(result, Exception) else hashlib.sha256(repr(result).encode()).hexdigest()
    parts = comm.all_gather_object(mine, group=mesh.sp_group)
    for p in parts:
        if isinstance(p, Exception):
            raise SeqParError(str(p))
    if len(set(parts)) > 1:
        raise SeqParError(f"the vLLM engine's tensor-parallel ranks {group_source_rank(mesh)}.."
                          f"{group_source_rank(mesh) + mesh.sp_size - 1} returned different completions: set "
                          "grpo.rollout.tensor_parallel: 1")
