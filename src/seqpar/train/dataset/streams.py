"""Feeding the loop: one endless, resumable stream of row indices per dp slot this process plays, and
the collator that turns rows into this rank's SP shard (SFT, packed SFT, DPO pairs, vision rows).
"""

from __future__ import annotations

from typing import Any

from ...data import (
    SequenceParallelCollator,
    SequenceParallelDPOCollator,
    SequenceParallelSampler,
    VisionCollator,
    VisionDPOCollator,
)
from ...errors import SeqParError
from ..config import DatasetSpec, TrainConfig
from ..model.load import ModelInfo, model_info

__all__ = ["DataStream", "build_data", "make_collator"]


# ----------------------------------------------------------------------------- data streams
class DataStream:
    """Row indices for one dp slot, read from the run's GLOBAL row order; resumable at any layout.

    The global order is epoch after epoch, without padding: epoch e is the dataset's rows in the order of a
    one-replica `SequenceParallelSampler` at epoch e (shuffled by seed + e, or in file order). A step takes the
    next global-batch rows of it; dp slot d of D takes rows d, d + D, d + 2D, ... of the step's block. So
    `rows` (rows consumed since the start of training) is the same on every rank at a step boundary and means
    the same row at any world / SP / dp size: a checkpoint stores it, a resume on another layout continues
    there (train/lifecycle/run_layout.py). With a dataset size that dp divides this is exactly the
    per-slot order of SequenceParallelSampler (DistributedSampler's rank::D slices); otherwise a step may take
    rows of two epochs where the sampler would repeat rows of one (its wrap-around padding).
    """

    def __init__(self, n_rows: int, dp_size: int = 1, dp_rank: int = 0, shuffle: bool = True, seed: int = 0) -> None:
        if n_rows < 1 or not 0 <= dp_rank < dp_size:
            raise SeqParError(f"a data stream needs rows (got {n_rows}) and a dp slot in [0, {dp_size}), got {dp_rank}")
        self.n, self.dp_size, self.dp_rank, self.shuffle, self.seed = n_rows, dp_size, dp_rank, shuffle, seed
        self.base = 0  # the global row position this slot started from (a resume point)
        self.taken = 0  # rows this slot took since
        self._order: tuple[int, list[int]] | None = None  # (epoch, its row order)

    @property
    def rows(self) -> int:
        """Global rows consumed (every slot's share of every step so far), the same on every slot between steps."""
        return self.base + self.dp_size * self.taken

    def _row(self, position: int) -> int:
        epoch, i = divmod(position, self.n)
        if self._order is None or self._order[0] != epoch:
            sampler = SequenceParallelSampler(self.n, 1, 0, shuffle=self.shuffle, seed=self.seed)
            sampler.set_epoch(epoch)
            self._order = (epoch, list(sampler))
        return self._order[1][i]

    def take(self, k: int) -> list[int]:
        start = self.base + self.dp_rank + self.dp_size * self.taken
        self.taken += k
        return [self._row(start + self.dp_size * j) for j in range(k)]

    def state_dict(self) -> dict[str, int]:
        return {"rows": self.rows, "epoch": self.rows // self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """{"rows": position} (any layout wrote it)."""
        rows = int(state["rows"])
        if rows < 0:
            raise SeqParError(f"a data position must be >= 0 rows, got {rows}")
        self.base, self.taken = rows, 0


def build_data(cfg: TrainConfig, mesh: Any, tok: Any, n_examples: int, emulate_dp: int,
               info: ModelInfo | None = None, one_stream: bool = False) -> tuple[list, Any]:
    """One row stream per dp slot this process plays (1, or emulate_dp in the SP=1 reference; one_stream: one
    stream of the whole global batch, as length-aware SP plans every step's rows on every rank), and the
    collator."""
    slots = [(mesh.dp_size, mesh.dp_rank)] if emulate_dp == 1 else [(emulate_dp, d) for d in range(emulate_dp)]
    if one_stream:
        slots = [(1, 0)]
    streams = [DataStream(n_examples, n, d, shuffle=cfg.dataset.shuffle, seed=cfg.seed) for n, d in slots]
    return streams, make_collator(cfg, mesh, tok, cfg.dataset, info)


def make_collator(cfg: TrainConfig, mesh: Any, tok: Any, ds: DatasetSpec, info: ModelInfo | None = None) -> Any:
    """The collator of dataset `ds`: DPO pairs, vision-language rows, or SFT / GRPO rows (info: the run's model
    config, default read here)."""
    vlm = (info or model_info(cfg)).vlm
    if cfg.stage == "dpo":
        pairs = VisionDPOCollator if vlm else SequenceParallelDPOCollator
        return pairs(mesh, tok.pad_token_id, max_length=ds.max_length)
    kind = VisionCollator if vlm else SequenceParallelCollator
    return kind(mesh, tok.pad_token_id, packing=ds.packing, max_length=ds.max_length)
