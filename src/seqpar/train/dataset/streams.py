"""Feeding the loop: one endless, resumable stream of row indices per dp slot this process plays, and
the collator that turns rows into this rank's SP shard (SFT, packed SFT, DPO pairs, vision rows).
"""

from __future__ import annotations

from typing import Any

from ...data import SequenceParallelCollator, SequenceParallelDPOCollator, SequenceParallelSampler
from ..config import DatasetSpec, TrainConfig
from ..model.load import ModelInfo, model_info
from .images import VisionCollator

__all__ = ["DataStream", "build_data", "make_collator"]


# ----------------------------------------------------------------------------- data streams
class DataStream:
    """Endless row indices for one dp slot: epochs of a SequenceParallelSampler, resumable mid-epoch."""

    def __init__(self, sampler: SequenceParallelSampler) -> None:
        self.sampler = sampler
        self._it = None

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self._it is None:
                self._it = iter(self.sampler)
            try:
                out.append(next(self._it))
            except StopIteration:
                self.sampler.set_epoch(self.sampler.epoch + 1)
                self._it = None
        return out

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self._it = None


def build_data(cfg: TrainConfig, mesh: Any, tok: Any, n_examples: int, emulate_dp: int,
               info: ModelInfo | None = None) -> tuple[list, Any]:
    """One row stream per dp slot this process plays (1, or emulate_dp in the SP=1 reference), and the collator."""
    slots = [(mesh.dp_size, mesh.dp_rank)] if emulate_dp == 1 else [(emulate_dp, d) for d in range(emulate_dp)]
    streams = [
        DataStream(SequenceParallelSampler(n_examples, n, d, shuffle=cfg.dataset.shuffle, seed=cfg.seed))
        for n, d in slots
    ]
    return streams, make_collator(cfg, mesh, tok, cfg.dataset, info)


def make_collator(cfg: TrainConfig, mesh: Any, tok: Any, ds: DatasetSpec, info: ModelInfo | None = None) -> Any:
    """The collator of dataset `ds`: DPO pairs, vision-language rows, or SFT / GRPO rows (info: the run's model
    config, default read here)."""
    if cfg.stage == "dpo":
        return SequenceParallelDPOCollator(mesh, tok.pad_token_id, max_length=ds.max_length)
    kind = VisionCollator if (info or model_info(cfg)).vlm else SequenceParallelCollator
    return kind(mesh, tok.pad_token_id, packing=ds.packing, max_length=ds.max_length)
