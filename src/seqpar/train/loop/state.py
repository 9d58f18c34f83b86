"""What the loop carries: the Loop (model, optimizer, data, step spec, ... of one run on this rank) and the
TrainResult `train()` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...loss.grad_sync import OverlappedGradSum
from ...steps import StepSpec
from ..config import TrainConfig
from ..dataset.streams import DataStream
from ..grpo.rollout import GRPORollout
from ..model.precision import MasterWeights

__all__ = ["Loop", "TrainResult"]


@dataclass
class TrainResult:
    output_dir: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, eval_loss)
    resumed_from: int | None = None
    metrics_path: str | None = None
    final_state_path: str | None = None
    plot_path: str | None = None
    export_path: str | None = None
    world_size: int = 1
    mesh: str = ""
    peak_alloc: list[dict] = field(default_factory=list)  # this rank's memory meter reading per step


@dataclass
class Loop:
    """What the loop's pieces share: built once (build_loop), read by train_step and the run's bookkeeping."""

    cfg: TrainConfig
    mesh: Any
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    streams: list[DataStream]
    collator: Any
    examples: list
    spec: StepSpec
    reference: Any
    device: torch.device
    world: int
    rank: int
    out: Path
    factor: float = 1.0
    meter: Any = None  # seqpar.memory.meter.PeakMemoryMeter when memory.measure
    prec: MasterWeights | None = None  # bf16 without FSDP: fp32 masters behind `params` / the optimizer
    eval_examples: list | None = None
    eval_collator: Any = None
    tensorboard: Any = None
    nonfinite_streak: int = 0  # consecutive skipped (non-finite) steps
    rollout: GRPORollout | None = None  # stage: grpo: builds each step's micro-batches (grpo/rollout.py)
    grad_sum: OverlappedGradSum | None = None  # replicated gradients on > 1 rank: summed during backward
    dynamic: Any = None  # size: dynamic: loop/dynamic.py's DynamicRun (meshes, scheduler, collators)
