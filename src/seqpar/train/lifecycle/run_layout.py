"""Where a run stands at any layout: the layout a checkpoint was written at (world, dp x sp = ulysses x ring,
FSDP2, the global batch), its data position in rows, and what resuming it on another layout changes.

checkpoint-N/run.json = {"config", "world_size", "layout": RunLayout fields, "rows": rows consumed, "examples": n}.
Nothing else in a checkpoint depends on the layout: torch.distributed.checkpoint stores model and optimizer
state by parameter name and reshards it on load (plain <-> FSDP2, any world size), the schedule is a function
of the step, and the data position counts rows of the run's global row order (train/dataset/streams.py). So a
checkpoint continues at any valid layout, and with the same global batch the steps are the uninterrupted run's
(losses are normalised over the global token count and SP is exact). A different global batch changes the
trajectory from there on: `resume_lines` says how (steps per epoch, the row the data continues at).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig, config_from_dict, rows_per_step

__all__ = ["RunLayout", "row_unit", "checkpoint_rows", "resume_lines", "layout_meta"]


def row_unit(cfg: TrainConfig) -> str:
    """What one row of the data stream is: a packed row, a GRPO prompt, or an example."""
    return "packed rows" if cfg.dataset.packing else ("prompts" if cfg.stage == "grpo" else "examples")


@dataclass(frozen=True)
class RunLayout:
    """The layout of one launch. ulysses / ring None: not recorded (a checkpoint from before run.json had it).
    max_local_tokens: set for length-aware SP (sp is then its largest degree, whose dp sets the rows per step)."""

    world: int
    dp: int
    sp: int
    ulysses: int | None
    ring: int | None
    fsdp: bool
    micro_batch_size: int
    grad_accum: int
    rows_per_step: int
    unit: str
    max_local_tokens: int | None = None

    @classmethod
    def of(cls, cfg: TrainConfig, world: int, ulysses: int | None = None, ring: int | None = None,
           dp: int | None = None, sp: int | None = None) -> RunLayout:
        """cfg (grad_accum resolved for this dp) at `world` processes; dp: the dp slots played (verify's reference
        plays several in one process), default world // sp; sp: the SP size rows are counted at (size: dynamic:
        its largest degree, train.config.rows_sp_size), default the fixed size."""
        spec = cfg.sequence_parallel
        if sp is None:
            if spec.dynamic:
                raise ValueError("RunLayout.of a size: dynamic run needs sp= (train.config.rows_sp_size)")
            sp = spec.size
        dp = dp if dp is not None else max(1, world // sp)
        return cls(world, dp, sp, ulysses, ring, bool(cfg.fsdp), cfg.micro_batch_size, cfg.grad_accum,
                   rows_per_step(cfg, dp), row_unit(cfg), spec.max_local_tokens if spec.dynamic else None)

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> RunLayout:
        """The layout run.json records, or (older checkpoints) the one its config and world size imply."""
        if "layout" in meta:
            return cls(**meta["layout"])
        cfg = config_from_dict(meta["config"])
        return cls.of(cfg, int(meta["world_size"]))

    def mesh(self) -> str:
        """e.g. 'world 4 (dp 1 x sp 4: ulysses 2 x ring 2, FSDP2)', or with length-aware SP 'world 4 (length-aware
        SP, degrees up to 4, max_local_tokens 32)'."""
        fsdp = ", FSDP2" if self.fsdp else ""
        if self.max_local_tokens is not None:
            return (f"world {self.world} (length-aware SP, degrees up to {self.sp}, max_local_tokens "
                    f"{self.max_local_tokens}{fsdp})")
        deg = f": ulysses {self.ulysses} x ring {self.ring}" if self.ulysses is not None and self.sp > 1 else ""
        return f"world {self.world} (dp {self.dp} x sp {self.sp}{deg}{fsdp})"

    def batch(self) -> str:
        """e.g. 'dp 2 x micro_batch_size 1 x grad_accum 2'."""
        return f"dp {self.dp} x micro_batch_size {self.micro_batch_size} x grad_accum {self.grad_accum}"


def layout_meta(layout: RunLayout, rows: int, examples: int | None) -> dict[str, Any]:
    """What run.json adds to the config and world size: the layout, the data position and (when known) the
    dataset's size, which a resume must find again."""
    meta = {"layout": asdict(layout), "rows": int(rows)}
    return meta if examples is None else {**meta, "examples": int(examples)}


def checkpoint_rows(ckpt: Path, meta: dict[str, Any], examples: int) -> int:
    """The checkpoint's data position in global rows. Checkpoints from before run.json recorded it hold
    per-dp-slot sampler states {"epoch", "num_consumed"}: rows = epoch x examples + num_consumed x dp."""
    if "rows" in meta:
        return int(meta["rows"])
    state = torch.load(ckpt / "trainer_state_rank0.pt", weights_only=False)["data"]
    first = state[0] if isinstance(state, list) else state
    if "rows" in first:
        return int(first["rows"])
    dp = RunLayout.from_meta(meta).dp
    return int(first["epoch"]) * examples + min(int(first["num_consumed"]) * dp, examples)


def _epoch_at(rows: int, n: int, unit: str) -> str:
    epoch, done = divmod(rows, n)
    return f"row {rows} (epoch {epoch}: {done} of its {n} {unit} done)"


def resume_lines(ckpt: Path, saved: RunLayout, now: RunLayout, rows: int, examples: int) -> list[str]:
    """What resuming `ckpt` at layout `now` does, one line each (empty: the layout and batch are the saved ones)."""
    lines = []
    moved = (saved.world, saved.dp, saved.sp, saved.fsdp, saved.max_local_tokens) != (
        now.world, now.dp, now.sp, now.fsdp, now.max_local_tokens) or (
        None not in (saved.ulysses, now.ulysses) and (saved.ulysses, saved.ring) != (now.ulysses, now.ring))
    if moved:
        rng = "" if saved.world == now.world else (
            "; the world size changed, so every rank continues rank 0's saved torch RNG (only dropout draws from it)")
        lines.append(f"{ckpt.name} was written at {saved.mesh()}, this run is {now.mesh()}: torch.distributed."
                     f"checkpoint reshards the model and optimizer state on load{rng}")
    u = now.unit
    if saved.rows_per_step == now.rows_per_step:
        if moved or (saved.micro_batch_size, saved.grad_accum) != (now.micro_batch_size, now.grad_accum):
            lines.append(f"global batch kept: {now.rows_per_step} {u} per step ({saved.batch()} -> {now.batch()}); "
                         f"the data continues at {_epoch_at(rows, examples, u)}, as the uninterrupted run's would")
        return lines
    per = (math.ceil(examples / saved.rows_per_step), math.ceil(examples / now.rows_per_step))
    lines.append(f"global batch {saved.rows_per_step} -> {now.rows_per_step} {u} per step ({saved.batch()} -> "
                 f"{now.batch()}): steps per epoch {per[0]} -> {per[1]}; the data continues at "
                 f"{_epoch_at(rows, examples, u)}; from here the steps differ from a run at the old global batch "
                 f"(to keep it: global_batch_size: {saved.dp * saved.micro_batch_size * saved.grad_accum})")
    return lines
