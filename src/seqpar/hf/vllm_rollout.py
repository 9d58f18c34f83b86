"""GRPO completions for an SP group from colocated vLLM engines (seqpar.hf.vllm_engine): what both GRPO trainers
share (`seqpar train`'s `grpo.rollout.engine: vllm`, the TRL drop-in's `use_vllm`).

`VLLMRollout` holds this rank's engine (started at the first rollout, every rank at once: vLLM's groups are
collective) and samples with the same contract as seqpar.hf.generation.generate_for_group: each row seeded by its own
seed (`row_seed`, the same seeds as the transformers engine), every rank of the group ends with the group's rows, and
a completion depends on its seed alone (not on the SP or dp size, nor on the engines' tensor-parallel size). Before
sampling every rank pushes the policy's current full weights into its engine (seqpar.hf.weight_stream: FSDP2's
gathers are collective, so every rank pushes, in the same order; with tensor_parallel > 1 vLLM's weight loaders keep
each rank's shard of them).

tensor_parallel 1: one engine per rank; every SP rank samples its share of the rows and the shares are all-gathered.
tensor_parallel = SP size: one engine per SP group (its TP group); every rank submits all the group's rows, as
vLLM's external launcher wants, and gets them all back; the ranks agree that every engine started and took the
weights before any of them samples (sampling is collective over the TP group), then compare a digest of what they
got, so engines that drifted apart fail loudly instead of training different rows.
Any failure (start, push, sampling, a dead engine) reaches every rank of the group as the same SeqParError; with
tensor_parallel > 1 a failure inside one rank's sampling leaves its TP peers in vLLM's collectives until vLLM's
collective timeout (the run's timeout_minutes), where they fail too: no hang.
With `sleep` (CUDA) every rank's engine sleeps right after its rollout (so once per rollout, not per training step
when num_iterations > 1) and wakes in the next rollout's push (seqpar.hf.vllm_engine); a failed wake or sleep is
reported like any other failure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import comm
from ..errors import SeqParError
from ..layout import shard
from ..mesh import SequenceParallelMesh
from ..unwrap import base_model
from .generation import gather_shares, group_source_rank, local_rows, prompt_share, row_seed, sequence_parallel_paused
from .weight_stream import named_full_weights

__all__ = ["VLLMSettings", "VLLMRollout", "trl_row_seeds", "placed_rollout_logps"]


@dataclass(frozen=True)
class VLLMSettings:
    """The engine's settings, from either trainer's options. sleep_option: the option's name, for the CPU notice."""

    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = True
    sleep: bool = False
    sleep_option: str = "grpo.rollout.sleep"
    tensor_parallel: int = 1  # 1: one engine per rank; the SP size: one per SP group (the module docstring)
    timeout_s: float | None = None  # vLLM's collective timeout (tensor_parallel > 1)


class VLLMRollout:
    """This rank's engine and the rollouts it samples for the SP group (see the module docstring)."""

    def __init__(self, settings: VLLMSettings) -> None:
        self.settings = settings
        self.engine: Any = None

    def _engine(self, model: torch.nn.Module, mesh: SequenceParallelMesh) -> Any:
        if self.engine is None:
            from .vllm_engine import VLLMEngine, sleep_mode_available

            s = self.settings
            if s.sleep and not sleep_mode_available() and mesh.dp_rank == 0 and mesh.sp_rank == 0:
                print(f"[seqpar] {s.sleep_option}: a no-op on CPU (vLLM's CPU platform has no sleep mode): the "
                      "engine keeps its memory", flush=True)
            self.engine = VLLMEngine(
                base_model(model).config, max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
                dtype=next(model.parameters()).dtype, gpu_memory_utilization=s.gpu_memory_utilization,
                enforce_eager=s.enforce_eager, sleep=s.sleep,
                rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
                tensor_parallel=s.tensor_parallel, timeout_s=s.timeout_s,
                expect_group=range(group_source_rank(mesh), group_source_rank(mesh) + mesh.sp_size)
                if s.tensor_parallel > 1 else None)
        return self.engine

    def for_prompts(self, model: torch.nn.Module, mesh: SequenceParallelMesh, prompt_ids: Sequence[Sequence[int]], *,
                    num_generations: int, seed: int, step: int, prompt_index: Sequence[int] | None = None,
                    **sampling: Any) -> tuple[list[list[int]], list[list[float]]]:
        """(completions, the engine's log-probs of their tokens) for this SP group's prompts, prompt-major
        ([p0 g0, p0 g1, ..., p1 g0, ...]); each SP rank samples its `prompt_share` of the prompts."""
        whole = self._whole(mesh)
        share = range(len(prompt_ids)) if whole else prompt_share(len(prompt_ids), mesh.sp_size, mesh.sp_rank)
        rows, seeds = local_rows(prompt_ids, share, num_generations, seed, step, mesh.dp_rank, prompt_index)
        return self._sample(model, mesh, rows, seeds, sampling)

    def for_rows(self, model: torch.nn.Module, mesh: SequenceParallelMesh, rows: Sequence[Sequence[int]],
                 seeds: Sequence[int], *, unit: int, **sampling: Any) -> tuple[list[list[int]], list[list[float]]]:
        """The same for the group's rows as given (each with its seed): each SP rank samples a contiguous share of
        whole blocks of `unit` rows (a prompt's generations; 1 when they do not tile the rows)."""
        u = unit if unit > 0 and len(rows) % unit == 0 else 1
        share = range(len(rows) // u) if self._whole(mesh) else prompt_share(len(rows) // u, mesh.sp_size,
                                                                              mesh.sp_rank)
        mine = range(share.start * u, share.stop * u)
        return self._sample(model, mesh, [list(rows[i]) for i in mine], [int(seeds[i]) for i in mine], sampling)

    def _sample(self, model: torch.nn.Module, mesh: SequenceParallelMesh, rows: list[list[int]], seeds: list[int],
                sampling: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
        return _push_sample_gather(lambda: self._engine(model, mesh), model, mesh, rows, seeds, sampling,
                                   self._whole(mesh))

    def _whole(self, mesh: SequenceParallelMesh) -> bool:
        """One engine per SP group: every rank submits the group's rows (the module docstring)."""
        tp = self.settings.tensor_parallel
        if tp > 1 and tp != mesh.sp_size:
            raise SeqParError(f"tensor_parallel={tp} must be 1 or the SP size {mesh.sp_size}")
        return tp > 1

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _push_sample_gather(engine: Callable[[], Any], model: torch.nn.Module, mesh: SequenceParallelMesh,
                        rows: list[list[int]], seeds: list[int],
                        sampling: dict[str, Any], whole: bool) -> tuple[list[list[int]], list[list[float]]]:
    """Every rank pushes the weights (FSDP2: collective; a sleeping engine wakes), samples its rows, puts its engine
    to sleep (sleep mode: a rank without rows too), and the shares are all-gathered (whole: every rank sampled all the
    group's rows with its TP peers; they are checked to agree instead)."""
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
            ids, lps = eng.generate(rows, seeds, **sampling)
            result = list(zip(ids, lps))
        if eng is not None and not isinstance(result, Exception):
            eng.sleep()  # the memory to the training steps until the next rollout (a no-op without sleep mode)
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


def trl_row_seeds(n_rows: int, num_generations: int, seed: int, step: int, dp_rank: int) -> list[int]:
    """The TRL drop-in's row seeds: its dp rank holds rows dp_rank x n_rows ... of the step's generation batch (TRL's
    sampler repeats each prompt num_generations times in a row), so row r of that batch is generation r % G of
    prompt r // G, seeded as `seqpar train` seeds that prompt position: the same seeds at any SP or dp size."""
    g = num_generations
    first = dp_rank * n_rows
    return [row_seed(seed, step, 0, r // g, r % g) for r in range(first, first + n_rows)]


def placed_rollout_logps(prompt_lens: Sequence[int], logprobs: Sequence[Sequence[float]], width: int,
                         mesh: SequenceParallelMesh) -> torch.Tensor:
    """The sampler's log-probs at each completion token's target position (shift_labels) of a collated SP
    batch ([B, width] full length, rows left-aligned: prompt then completion), sharded as the batch is."""
    out = torch.zeros(len(prompt_lens), width, dtype=torch.float32)
    for i, (p, lp) in enumerate(zip(prompt_lens, logprobs)):
        out[i, p - 1:p - 1 + len(lp)] = torch.tensor(list(lp), dtype=torch.float32)
    return shard(out, mesh, dim=1)
