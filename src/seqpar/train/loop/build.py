"""Building the loop of one run on this rank: the SP mesh's model (model/build.py), the optimizer and
schedule, the data streams and collators, the step spec. The same function serves `seqpar train` and the
planner's measurements, so both time and meter exactly the step that trains.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ... import loss as L
from ...dynamic.meshes import DegreeMeshes
from ...errors import SeqParError
from ...loss.grad_sync import OverlappedGradSum
from ...mesh import SequenceParallelMesh
from ...steps import StepSpec
from ..config import TrainConfig
from ..dataset.streams import build_data, make_collator
from ..model.build import build_model
from ..model.load import ModelInfo, model_info
from .dynamic import build_dynamic
from .grads import fault_grad_scale
from .optim import build_optimizer
from .state import Loop

__all__ = ["build_loop", "step_spec", "refuse_partly_precomputed", "overlaps_grad_sync"]


def step_spec(cfg: TrainConfig) -> StepSpec:
    """The StepSpec of an SFT / DPO run (stage: grpo: grpo.rollout.grpo_step_spec)."""
    return StepSpec(cfg.stage, cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.gamma, cfg.memory.fused_loss,
                    cfg.memory.loss_chunk_tokens)


def refuse_partly_precomputed(cfg: TrainConfig, examples: list, eval_examples: list) -> None:
    """Under FSDP2 the frozen DPO reference is sharded (model/build.py): its forward is collective, so every
    rank must run it for every micro-batch. A batch with precomputed reference log-probs skips it; a dataset
    where only some pairs have them could let one rank skip while another waits. Refused up front (the
    examples are the same on every rank, so every rank raises here alike)."""
    if not (cfg.fsdp and cfg.stage == "dpo" and cfg.dpo.loss_type != "simpo" and cfg.finetuning.method != "lora"):
        return
    rows = [r for r in (*examples, *eval_examples) if isinstance(r, dict)]
    have = sum("ref_chosen_logps" in r for r in rows)
    if 0 < have < len(rows):
        raise SeqParError(f"{have} of {len(rows)} DPO pairs (train + eval) have precomputed ref_chosen_logps/"
                          "ref_rejected_logps: under fsdp the reference forward is collective, so precompute them "
                          "for every pair or for none")


def overlaps_grad_sync(cfg: TrainConfig, mesh: SequenceParallelMesh, world: int, masters: bool) -> bool:
    """Whether the replicated gradients are summed during backward (cfg.grad_sync). Never under FSDP (it
    reduce-scatters its own shards, overlapped) nor with fp32 masters (their gradients exist only after
    backward). "auto": on CUDA, where NCCL runs beside compute; on CPU / gloo the transfers would take the
    cores backward computes on (a full fine-tuning step at SP=2 measured ~4% slower overlapped)."""
    if world <= 1 or cfg.fsdp or masters or cfg.grad_sync == "after_backward":
        return False
    return cfg.grad_sync == "overlap" or mesh.comm_device.type == "cuda"


def build_loop(cfg: TrainConfig, mesh: SequenceParallelMesh, model: torch.nn.Module, tok: Any, examples: list,
               device: torch.device, world: int, rank: int, *, emulate_dp: int = 1, out: Path | None = None,
               eval_data: tuple[list, dict] | None = None, info: ModelInfo | None = None,
               meshes: DegreeMeshes | None = None, degrees: dict[int, tuple[int, int]] | None = None) -> Loop:
    """Everything one rank's loop needs, built in a fixed order (identical on every rank and in the SP=1
    reference). FSDP averages gradients, seqpar's loss convention sums them: the loss factor undoes that.
    info: the run's model config (default: read here). meshes / degrees: size: dynamic (mesh is then its
    largest degree's: the model is prepared on it, eval and GRPO's rollout run on it as a fixed run would)."""
    refuse_partly_precomputed(cfg, examples, eval_data[0] if eval_data else [])
    model, reference, prec = build_model(cfg, model, mesh, device, world)
    params = prec.masters if prec else [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(cfg, params)
    info = info or model_info(cfg)
    streams, collator = build_data(cfg, mesh, tok, len(examples), emulate_dp, info, one_stream=meshes is not None)
    factor = (L.gradient_reduction_factor(mesh) if cfg.fsdp else 1.0) * fault_grad_scale(world)
    overlap = meshes is None and overlaps_grad_sync(cfg, mesh, world, prec is not None)
    grad_sum = OverlappedGradSum(params, mesh) if overlap else None
    loop = Loop(cfg, mesh, model, params, optimizer, scheduler, streams, collator, examples, step_spec(cfg),
                reference, device, world, rank, out, factor=factor, prec=prec, grad_sum=grad_sum,
                eval_examples=eval_data[0] if eval_data else None,
                eval_collator=make_collator(cfg, mesh, tok, cfg.eval_dataset, info) if eval_data else None)
    if meshes is not None:
        loop.dynamic = build_dynamic(cfg, meshes, model, tok, info, degrees, device)
    return loop
