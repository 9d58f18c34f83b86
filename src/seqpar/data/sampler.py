"""The SP-aware sampler: every rank of an SP group gets the same rows, dp ranks disjoint ones; resumable mid-epoch."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized

import torch
from torch.utils.data import Sampler

from ..errors import SeqParError
from ..mesh import SequenceParallelMesh

__all__ = ["SequenceParallelSampler", "sp_sampler"]


class SequenceParallelSampler(Sampler[int]):
    """Indices for one dp rank: identical on every rank of an SP group, disjoint across dp ranks.

    Like DistributedSampler, but keyed on the mesh's dp rank (not the global rank, which would give
    each SP rank different rows). Shuffling depends only on (seed, epoch).
    Without drop_last, the index list is padded by wrapping around so every dp rank gets the same
    number of samples (a few rows are then seen twice per epoch).

    Mid-epoch resume: `state_dict()` = {"epoch", "num_consumed"} (samples this rank has yielded in
    the epoch); `load_state_dict` then makes the next iteration skip them. A DataLoader with
    num_workers > 0 pulls indices ahead of training, so save `{"epoch": e, "num_consumed":
    steps_done_in_epoch * batch_size}` from your loop instead of the sampler's own count.
    `set_epoch(e)` with a new epoch restarts at sample 0; with the current epoch it keeps the offset
    (so a loop that calls set_epoch(resumed_epoch) after load_state_dict resumes mid-epoch).
    Iterating again after an epoch is exhausted (num_consumed == len) starts the NEXT epoch, so a
    state saved at the very end of epoch e resumes with epoch e + 1, and a loop that forgets
    set_epoch still reshuffles.
    """

    def __init__(
        self, dataset_len: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(dataset_len, int) or dataset_len < 1:
            raise SeqParError(f"dataset_len must be a positive int, got {dataset_len!r}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise SeqParError(f"dp rank {rank} is not in [0, {num_replicas})")
        if drop_last and dataset_len < num_replicas:
            raise SeqParError(
                f"dataset_len={dataset_len} < dp_size={num_replicas} with drop_last=True leaves no sample: "
                f"use drop_last=False or a larger dataset"
            )
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.num_consumed = 0
        if drop_last:
            self.num_samples = dataset_len // num_replicas
        else:
            self.num_samples = math.ceil(dataset_len / num_replicas)

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            idx = list(range(self.dataset_len))
        total = self.num_samples * self.num_replicas
        while len(idx) < total:  # wrap around (dataset smaller than dp_size is allowed)
            idx += idx[: total - len(idx)]
        return idx[:total][self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.num_consumed >= self.num_samples:
            # This epoch is done (a finished pass, or a resumed state saved at its very end):
            # move on to the next one rather than replay it or yield nothing.
            self.epoch += 1
            self.num_consumed = 0
        idx = self._indices()
        while self.num_consumed < self.num_samples:
            i = idx[self.num_consumed]
            self.num_consumed += 1
            yield i

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.num_consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "num_consumed": self.num_consumed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        n = int(state["num_consumed"])
        if not 0 <= n <= self.num_samples:
            raise SeqParError(f"num_consumed={n} is outside [0, {self.num_samples}] for this sampler")
        self.epoch = int(state["epoch"])
        self.num_consumed = n


def sp_sampler(
    dataset_len: int | Sized, mesh: SequenceParallelMesh, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> SequenceParallelSampler:
    """A `SequenceParallelSampler` for this rank's dp slot (all SP ranks of the group get the same rows)."""
    n = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
    return SequenceParallelSampler(n, mesh.dp_size, mesh.dp_rank, shuffle, seed, drop_last)
