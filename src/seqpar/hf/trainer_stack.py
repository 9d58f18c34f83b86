"""The Trainer drop-ins inside the stack the Trainer sets up: DDP, FSDP2, DeepSpeed ZeRO 1-3, accelerate's
ParallelismConfig.

seqpar's loss shares need the SUM of gradients over all dp x sp ranks (seqpar.loss.gradient_reduction_factor).
DDP, FSDP2 (`fsdp="full_shard"`, fsdp_version 2) and DeepSpeed (stages 1-3, offload included) all AVERAGE
gradients over their data-parallel group, so each share is multiplied by dp x sp — provided that group is the
whole world. SP ranks hold the same parameters, so sharding them over dp x sp (as `seqpar train`'s FSDP2
does) is the same as sharding over dp. `wrapper_factor` checks the group at the first training step and
refuses anything else (a DeepSpeed Ulysses group, an FSDP mesh over part of the world) with a SeqParError.

DeepSpeed ZeRO-3 gathers a module's parameters at each call, over all ranks: every rank must make the same
calls in the same order. The SP forward already does (same layers on every rank, the fused loss calls
lm_head once per forward); tiled MLPs run one agreed tile count (`agree_gathers`).

A `parallelism_config` (TrainingArguments, or accelerate's PARALLELISM_CONFIG_* environment from
`accelerate launch --config_file`) becomes seqpar's mesh: sp_size or cp_size -> sequence_parallel_size,
dp_shard_size x dp_replicate_size -> the dp ranks; the config is then removed so that neither DeepSpeed's
Ulysses nor torch context parallelism runs underneath, and FSDP / ZeRO shard over the whole world.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from .. import loss as L
from ..errors import SeqParError
from ..memory.sharding import shard_over_world
from ..memory.tiled_mlp import same_tile_count
from ..mesh import SequenceParallelMesh

__all__ = ["prepare_reference", "fsdp_on_cpu", "load_stateless_fsdp_optimizer", "map_parallelism_config",
           "check_stack_args", "deepspeed_stage", "deepspeed_config", "wrapper_factor", "agree_gathers", "is_zero3"]


def _parallelism_config(args: Any) -> Any:
    pc = getattr(args, "parallelism_config", None)
    if pc is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        from accelerate.parallelism_config import ParallelismConfig

        pc = ParallelismConfig()  # sizes from accelerate launch's PARALLELISM_CONFIG_* variables
    return pc


def map_parallelism_config(name: str, args: Any, sequence_parallel_size: int | None) -> int | None:
    """The SP size an accelerate ParallelismConfig asks for (None: no config); removes it from `args`."""
    pc = _parallelism_config(args)
    if pc is None:
        return sequence_parallel_size
    if pc.tp_size > 1:
        raise SeqParError(f"{name}: parallelism_config tp_size={pc.tp_size} (tensor parallelism) is not supported "
                          "with seqpar's sequence parallelism: set tp_size=1")
    if pc.sp_size > 1 and pc.cp_size > 1:
        raise SeqParError(f"{name}: parallelism_config has sp_size={pc.sp_size} and cp_size={pc.cp_size}: seqpar "
                          "runs one sequence-parallel dimension (Ulysses, ring or both, chosen automatically): give "
                          "sp_size only (ulysses_degree= / ring_degree= choose the split)")
    sp = max(pc.sp_size, pc.cp_size)
    if sequence_parallel_size is not None and sequence_parallel_size != sp:
        raise SeqParError(f"{name}: sequence_parallel_size={sequence_parallel_size} but parallelism_config asks for "
                          f"{sp}: give one of them")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    total = pc.dp_replicate_size * pc.dp_shard_size * sp
    if total != world and world > 1:
        raise SeqParError(f"{name}: parallelism_config dp_replicate {pc.dp_replicate_size} x dp_shard "
                          f"{pc.dp_shard_size} x sp {sp} = {total} ranks, but WORLD_SIZE is {world}: make the "
                          "product equal the number of processes")
    args.parallelism_config = None
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)  # or the Accelerator rebuilds it from the env
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[seqpar] parallelism_config -> seqpar mesh: sequence_parallel_size={sp} (Ulysses/ring degrees "
              f"automatic unless given), dp={world // sp if world > 1 else 1}; FSDP / ZeRO shard over all "
              f"{max(world, 1)} ranks (seqpar replaces DeepSpeed's Ulysses / torch context parallelism)", flush=True)
    return sp


def _fsdp_from_env() -> bool:
    """`accelerate launch --config_file` with `distributed_type: FSDP` (and no fsdp= in TrainingArguments)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def deepspeed_config(args: Any) -> Any:
    """The HfDeepSpeedConfig the Trainer will run (None: no DeepSpeed): from `TrainingArguments(deepspeed=...)` or
    from accelerate's DeepSpeed plugin (`accelerate launch --config_file` with deepspeed_config fields)."""
    ds = getattr(args, "hf_deepspeed_config", None)
    if ds is None and getattr(args, "deepspeed_plugin", None) is not None:
        ds = args.deepspeed_plugin.hf_ds_config
    return ds


def deepspeed_stage(args: Any) -> int | None:
    """The ZeRO stage the Trainer will run (None: no DeepSpeed)."""
    ds = deepspeed_config(args)
    return None if ds is None else int(ds.get_value("zero_optimization.stage", 0) or 0)


def check_stack_args(name: str, args: Any) -> None:
    """FSDP / DeepSpeed settings the drop-ins cannot run exactly, refused before any process group."""
    fsdp = getattr(args, "fsdp", None)
    if fsdp:
        cfg = getattr(args, "fsdp_config", None) or {}
        version = int(cfg.get("version", cfg.get("fsdp_version", 1)))  # TrainingArguments drops the fsdp_ prefix
        if version != 2:
            raise SeqParError(f"{name}: FSDP version {version} is not supported: pass "
                              "fsdp_config={'fsdp_version': 2, ...} (FSDP2, per-parameter sharding)")
    elif _fsdp_from_env() and int(os.environ.get("FSDP_VERSION", "1")) != 2:
        raise SeqParError(f"{name}: FSDP version {os.environ.get('FSDP_VERSION', '1')} (from the accelerate config "
                          "file) is not supported: set `fsdp_version: 2` under fsdp_config in that file (FSDP2, "
                          "per-parameter sharding)")
    cfg = getattr(deepspeed_config(args), "config", None) or {}
    if int(cfg.get("sequence_parallel_size", 1) or 1) > 1:
        raise SeqParError(f"{name}: the DeepSpeed config sets sequence_parallel_size="
                          f"{cfg['sequence_parallel_size']}: remove it; seqpar's sequence_parallel_size replaces "
                          "DeepSpeed's Ulysses")


def fsdp_on_cpu(trainer: Any) -> None:
    """Give FSDP to accelerate on a multi-CPU (gloo) run, as it has it on GPUs.

    accelerate switches to FSDP only for accelerator devices; with `use_cpu=True` it silently keeps DDP, so a
    CPU run would not shard at all. Called right after the Trainer created its Accelerator: the FSDP plugin
    the Trainer builds from `fsdp` / `fsdp_config` goes to accelerate's state, and accelerate's own FSDP2
    preparation (fully_shard per `transformer_layer_cls_to_wrap` layer, then the root) runs as on GPU.
    """
    state = trainer.accelerator.state
    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    if plugin_args is None and not _fsdp_from_env():
        return
    if getattr(state, "fsdp_plugin", None) is not None or state.distributed_type.name != "MULTI_CPU":
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    # No arguments: the plugin reads accelerate launch's FSDP_* variables, as accelerate does on GPUs.
    plugin = FullyShardedDataParallelPlugin(**(plugin_args or {}))
    if state.mixed_precision != "no":  # as accelerate does for its own FSDP plugin
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    # Into PartialState's shared dict as well, as accelerate does on GPUs: every later AcceleratorState() (the
    # optimizer wrapper in prepare() makes one) copies it over the accelerator's, and with MULTI_CPU back there
    # get_state_dict (checkpoint saving) returned the sharded DTensors instead of the full weights.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def load_stateless_fsdp_optimizer(trainer: Any, checkpoint: str | None) -> bool:
    """Resume an FSDP2 run whose optimizer keeps no state (plain SGD); True when done here.

    torch's full-state-dict optimizer loading under FSDP2 (set_optimizer_state_dict, which the Trainer reaches
    through accelerate) fails on a state without any tensor ("Expected device to be set"). There is nothing to
    load but the groups' hyperparameters: those are copied and the scheduler is loaded as the Trainer does.
    """
    if checkpoint is None or not getattr(trainer, "is_fsdp_enabled", False):
        return False
    path = os.path.join(checkpoint, "optimizer.bin")  # accelerate's FULL_STATE_DICT file (SHARDED: a folder)
    if not os.path.isfile(path):
        return False
    saved = torch.load(path, map_location="cpu", weights_only=True)
    groups = trainer.optimizer.param_groups
    if saved.get("state") or len(saved.get("param_groups", ())) != len(groups):
        return False
    for group, kept in zip(groups, saved["param_groups"]):
        group.update({k: v for k, v in kept.items() if k != "params"})
    trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
    return True


def prepare_reference(trainer: Any, ref: torch.nn.Module) -> torch.nn.Module:
    """A frozen DPO reference model placed for the Trainer's stack (after it created its Accelerator).

    ZeRO-3: its own DeepSpeed inference engine (partitioned like the policy, no optimizer); FSDP2: sharded
    per decoder layer and at the root over all ranks, as the policy; otherwise: on `args.device` (not the
    policy's device at construction time: the Trainer moves the policy only later).
    """
    ref.eval().requires_grad_(False)
    if getattr(trainer, "is_deepspeed_enabled", False) and is_zero3(ref):
        import copy

        import deepspeed

        cfg = copy.deepcopy(trainer.accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            cfg.pop(key, None)
        cfg["zero_optimization"].pop("offload_optimizer", None)
        engine, *_ = deepspeed.initialize(model=ref, config=cfg)
        engine.eval()  # DeepSpeedEngine.eval() returns None (nn.Module.eval returns the module)
        return engine
    if getattr(trainer, "is_fsdp_enabled", False):
        ref.to(trainer.args.device)
        # reshard_after_forward: else FSDP2 keeps the root's weights (embeddings, norm, head) gathered after a
        # no-grad forward, for good, as nothing runs a backward through the frozen reference.
        shard_over_world(ref, trainer.args.device.type, torch.distributed.get_world_size(),
                         trainer.args.ddp_timeout_delta, reshard_after_forward=True)
        return ref
    return ref.to(trainer.args.device)


def _world(group: Any) -> int:
    return torch.distributed.get_world_size(group)


def _fsdp_size(model: torch.nn.Module) -> int | None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return None
    p = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    return None if p is None else p.device_mesh.size()


def _deepspeed_engine(model: torch.nn.Module) -> Any:
    ds = sys.modules.get("deepspeed")
    return model if ds is not None and isinstance(model, ds.DeepSpeedEngine) else None


def wrapper_factor(name: str, model: torch.nn.Module, mesh: SequenceParallelMesh, accelerator: Any) -> float:
    """dp x sp, after checking that `model`'s wrapper averages gradients over all dp x sp ranks."""
    from torch.nn.parallel import DistributedDataParallel

    world = mesh.world_size
    if isinstance(model, DistributedDataParallel):
        found, what = _world(model.process_group), "DDP"
    elif (engine := _deepspeed_engine(model)) is not None:
        found, what = engine.dp_world_size, "DeepSpeed's data-parallel group"
        if int(getattr(engine, "sequence_parallel_size", 1) or 1) > 1:
            raise SeqParError(f"{name}: DeepSpeed runs its own sequence parallelism "
                              f"(sequence_parallel_size={engine.sequence_parallel_size}): remove it from the config")
    elif (size := _fsdp_size(model)) is not None:
        found, what = size, "the FSDP2 mesh"
    elif accelerator.distributed_type.name == "NO":
        raise SeqParError(f"{name}: {world} ranks, but the Trainer set up no distributed training (accelerate "
                          "distributed_type NO), so gradients would not be reduced: on CPU pass "
                          "TrainingArguments(use_cpu=True)")
    else:
        raise SeqParError(f"{name}: the Trainer wrapped the model in {type(model).__name__}, which seqpar does not "
                          "know how gradients are reduced under: use DDP, FSDP2 (fsdp='full_shard', fsdp_version 2) "
                          "or DeepSpeed ZeRO 1-3")
    if found != world:
        raise SeqParError(f"{name}: {what} spans {found} ranks, not all dp x sp = {world}: gradients would be "
                          "averaged over part of the world; drop the custom process groups / mesh "
                          "(parallelism_config is mapped to seqpar's mesh by the drop-in)")
    return L.gradient_reduction_factor(mesh)


def is_zero3(model: torch.nn.Module) -> bool:
    """Parameters partitioned by DeepSpeed ZeRO-3 (gathered at each module call)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def agree_gathers(model: torch.nn.Module, inputs: dict[str, Any], mesh: SequenceParallelMesh) -> None:
    """Before a forward under ZeRO-3: every rank will run the same number of MLP tiles in it and in its
    backward recompute (one MAX all-reduce over seqpar's groups); elsewhere nothing. Call at the same point on
    every rank."""
    if mesh.world_size == 1 or not is_zero3(model):
        return
    cfg = getattr(getattr(model, "module", model), "config", None)
    hidden = getattr(cfg, "hidden_size", None) or getattr(getattr(cfg, "text_config", None), "hidden_size", 1)
    ids = inputs.get("input_ids")
    seq = int(ids.shape[-1]) if ids is not None else 1
    same_tile_count(model, seq, int(hidden), [mesh.sp_group, mesh.dp_group], mesh.comm_device)
