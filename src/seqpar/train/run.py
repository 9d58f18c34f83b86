"""`train(cfg)`: one run of `seqpar train` in this process (SFT / DPO / GRPO, full or LoRA, SP, FSDP2).

    cfg = seqpar.train.load_config("cfg.yaml")
    result = seqpar.train.run.train(cfg)      # under torchrun, or a single process

Order of work: config checks, model / tokenizer / dataset loading and every check that needs them run
BEFORE the process group exists (a bad config fails identically on every rank, nothing hangs); then the
process group and the output_dir lock, the SP mesh and the loop (loop/build.py), resume, the steps with
checkpoints and evals, and the end of the run (export, final state, loss plot).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..dynamic.meshes import init_degree_meshes
from ..errors import SeqParError, TrainingDiverged
from ..mesh import init_mesh, node_size_from_env
from ..threaded import serial
from .config import TrainConfig, dynamic_degrees, validate_for_launch, with_total_steps
from .dataset.identity import DataIdentity, data_identity
from .dataset.prepare import prepare_examples
from .grpo.engine import check_rollout_engine, trim_rollouts
from .grpo.rollout import GRPORollout, grpo_step_spec
from .lifecycle.checkpoint import full_model_state, latest_checkpoint, load_checkpoint, save_checkpoint
from .lifecycle.export import export_trained
from .lifecycle.process import (
    init_process_group,
    maybe_fault,
    quiet_non_main_ranks,
    rank0_decides,
    take_lock,
    watch_parent,
)
from .lifecycle.resume import check_output_dir, resume_point, resume_start, run_meta
from .lifecycle.run_layout import RunLayout
from .loop.build import build_loop
from .loop.dynamic_step import measured_dynamic_step
from .loop.evaluation import maybe_eval
from .loop.metrics import log_row, open_tensorboard, report_data_stats, trim_metrics
from .loop.plots import plot_curves, read_metrics
from .loop.state import Loop, TrainResult
from .loop.step import measured_step
from .model.build import check_memory_features
from .model.checks import check_model
from .model.load import ModelInfo, load_model, load_tokenizer, loaded_heads, model_info

__all__ = ["train", "TrainResult"]


@dataclass
class _Prepared:
    """What the checks before the process group produced: the run's inputs, identical on every rank."""

    cfg: TrainConfig
    tok: Any
    examples: list
    data_stats: dict[str, int]
    eval_data: tuple[list, dict] | None
    model: torch.nn.Module
    ulysses: int
    ring: int
    node_size: int  # processes per node (LOCAL_WORLD_SIZE); < world over several nodes
    info: ModelInfo  # the model's config, read once for the whole run
    layout: RunLayout  # world, dp x sp, FSDP2, the global batch: what a checkpoint records, what a resume compares
    data: DataIdentity  # the examples' size and fingerprint: what a checkpoint records, what a resume must find again
    degrees: dict[int, tuple[int, int]] | None = None  # size: dynamic: {degree: (ulysses, ring)}


def train(cfg: TrainConfig, *, emulate_dp: int = 1) -> TrainResult:
    """Train per `cfg`. Launch under torchrun for several ranks (or call inside an initialised group).

    emulate_dp: used by `seqpar verify` for the single-process reference: one process plays `emulate_dp`
    dp ranks (same rows per step, same micro-batches, same global normalisation) with SP=1.
    """
    pg_ready = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if pg_ready else int(os.environ.get("WORLD_SIZE", "1"))
    if emulate_dp > 1 and (world != 1 or cfg.sequence_parallel.size != 1):
        raise SeqParError("emulate_dp is for single-process SP=1 references only")
    quiet_non_main_ranks()
    watch_parent()
    prep = _prepare(cfg, world, emulate_dp)
    created_pg = _start_process_group(prep.cfg, world, pg_ready)
    rank = dist.get_rank() if world > 1 else 0
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # over several nodes rank 0 checks output_dir (the nodes may not share it) under the lock
    check = (lambda: check_output_dir(prep.cfg, prep.layout, prep.data)) if prep.node_size < world else None
    lock = take_lock(prep.cfg, world, rank, check_dir=check)
    try:
        return _run(prep, world, rank, device, emulate_dp)
    finally:
        lock.release()
        if created_pg:
            dist.destroy_process_group()


def _prepare(cfg: TrainConfig, world: int, emulate_dp: int) -> _Prepared:
    """Everything that can fail on the config, before any process group exists; loads the model (seeded)."""
    info = model_info(cfg)
    nh, nkv = info.heads
    node = node_size_from_env(world)
    u, r = validate_for_launch(cfg, world, num_heads=nh, num_kv_heads=nkv, recurrent=info.recurrent,
                               node_size=node)
    tok = load_tokenizer(cfg)
    if cfg.stage == "grpo" and emulate_dp > 1:
        raise SeqParError("stage: grpo has no emulated-dp reference (seqpar verify): compare runs with dp=1 instead")
    examples, data_stats = prepare_examples(cfg, tok, info=info)
    eval_data = prepare_examples(cfg, tok, cfg.eval_dataset, info) if cfg.eval_dataset is not None else None
    degrees = (dynamic_degrees(cfg, world, nh, nkv, recurrent=info.recurrent, node_size=node)
               if cfg.sequence_parallel.dynamic else None)
    sp = max(degrees) if degrees else cfg.sequence_parallel.size
    dp = emulate_dp if emulate_dp > 1 else world // sp
    # global_batch_size -> grad_accum at this dp; num_epochs -> max_steps (continuing a resumed data position)
    cfg = with_total_steps(cfg, len(examples), dp, start=resume_start(cfg, len(examples)))
    layout = RunLayout.of(cfg, world, u, r, dp=dp, sp=sp)
    check_model(cfg, examples, info)
    check_rollout_engine(cfg, info.config, sp)
    data = data_identity(cfg.dataset.path, examples)
    if node == world:  # one node: every rank sees the folder; over nodes rank 0 checks it (take_lock)
        check_output_dir(cfg, layout, data)  # another run's checkpoint, or results a fresh start replaces
    with serial():  # the seeded global RNG builds the model: ranks that are threads (seqpar.threaded) take turns
        torch.manual_seed(cfg.seed)
        model = load_model(cfg, info)
    if loaded_heads(model) != (nh, nkv):
        raise SeqParError(f"model has heads {loaded_heads(model)} but its config said {(nh, nkv)}")
    check_memory_features(cfg, model, on_accelerator=torch.cuda.is_available())
    return _Prepared(cfg, tok, examples, data_stats, eval_data, model, u, r, node, info, layout, data, degrees)


def _start_process_group(cfg: TrainConfig, world: int, pg_ready: bool) -> bool:
    """The process group this run needs, unless one exists; returns whether it was created here."""
    if world > 1 and not pg_ready:
        init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=cfg.collective_timeout)
        return True
    if cfg.fsdp and not pg_ready:
        # FSDP2 needs a process group even on one rank (the bf16 reference of `seqpar verify` uses this).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True
    return False


def _run(prep: _Prepared, world: int, rank: int, device: torch.device, emulate_dp: int) -> TrainResult:
    cfg, sp = prep.cfg, prep.cfg.sequence_parallel
    meshes = None
    if prep.degrees is not None:  # every degree's process groups, once (each creation is collective)
        meshes = init_degree_meshes(prep.degrees, world, rank, layout=sp.layout, node_size=prep.node_size,
                                    timeout=cfg.collective_timeout, state_passing=sp.state_passing)
        mesh = meshes.meshes[meshes.top]
    else:
        mesh = init_mesh(sp.size, ulysses_degree=prep.ulysses, ring_degree=prep.ring, layout=sp.layout,
                         node_size=prep.node_size, timeout=cfg.collective_timeout, state_passing=sp.state_passing)
    out = Path(cfg.output_dir)
    loop = build_loop(cfg, mesh, prep.model, prep.tok, prep.examples, device, world, rank, emulate_dp=emulate_dp,
                      out=out, eval_data=prep.eval_data, info=prep.info, meshes=meshes, degrees=prep.degrees)
    if cfg.memory.measure:
        # imported here: torch's MemTracker pulls in dynamo and inductor (about 1 s of every rank's start)
        from ..memory.meter import PeakMemoryMeter

        # CUDA: the allocator's exact peak, without the tracker's per-op Python cost (no split by category).
        extra = (getattr(loop.reference, "ref_model", None), loop.prec.module if loop.prec else None)
        loop.meter = PeakMemoryMeter(loop.model, loop.optimizer, device, extra=extra, categories=device.type != "cuda")
    start_step = _restore(loop, prep)
    if cfg.stage == "grpo":
        loop.spec, loop.rollout = grpo_step_spec(cfg), GRPORollout(cfg, mesh, prep.tok, prep.examples, loop.collator)
    metrics_path = out / "metrics.jsonl"
    if rank == 0:
        trim_metrics(metrics_path, start_step)
        trim_rollouts(out / "rollouts.jsonl", start_step)  # grpo.log_rollouts appends step by step
        if start_step == 0:
            (out / "config.json").write_text(cfg.model_dump_json(indent=2))
        (out / "mesh.txt").write_text(f"{mesh!r} world={world}\n")
    result = TrainResult(output_dir=str(out), resumed_from=start_step or None, metrics_path=str(metrics_path),
                         world_size=world, mesh=repr(mesh))
    try:
        step = _steps(loop, result, metrics_path, start_step, prep)
    finally:
        if loop.rollout is not None:
            loop.rollout.engine.close()  # a vLLM engine and its process groups (nothing for transformers)
    export_final(loop, prep.tok, result, step)
    finish(loop, result, metrics_path)
    return result


def _restore(loop: Loop, prep: _Prepared) -> int:
    """The output folder, and the model / optimizer / schedule / data position of the checkpoint to resume
    from (if any), at this run's layout; returns the step to start at."""
    out = loop.out
    if loop.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if loop.world > 1:
        dist.barrier()
    # Rank 0's view of the folder decides (nodes need not share it: take_lock refuses checkpoints then).
    plan = rank0_decides(lambda: resume_point(loop.cfg, prep.layout, prep.data, 0, out), loop.world, loop.rank)
    if plan is None:
        return 0
    state = load_checkpoint(plan.ckpt, _state_model(loop), loop.optimizer, trainable_only=_lora(loop),
                            same_world=plan.saved.world == loop.world)
    if loop.prec:
        loop.prec.masters_to_model()
    loop.scheduler.load_state_dict(state["scheduler"])
    for s in loop.streams:
        s.load_state_dict({"rows": plan.rows})  # global rows: the same position at any layout
    return int(state["step"])


def _steps(loop: Loop, result: TrainResult, metrics_path: Path, start_step: int, prep: _Prepared) -> int:
    """The steps from start_step to max_steps, with metrics, checkpoints, evals; returns the last step."""
    from tqdm.auto import tqdm

    cfg, rank = loop.cfg, loop.rank
    if rank == 0:
        print(_start_line(loop, len(prep.examples), start_step), flush=True)
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=(rank != 0 or not cfg.progress),
               desc=f"{cfg.stage} sp={loop.mesh.sp_size} dp={loop.mesh.dp_size}", dynamic_ncols=True)
    report_data_stats(cfg, rank, prep.data_stats, prep.eval_data[1] if prep.eval_data else None)
    loop.tensorboard = open_tensorboard(cfg, rank, loop.out)
    step = start_step
    t_start = time.perf_counter()
    while step < cfg.max_steps:
        row = measured_dynamic_step(loop, step) if loop.dynamic is not None else measured_step(loop, step)
        if loop.meter is not None:
            result.peak_alloc.append(loop.meter.last)
        step += 1
        row["elapsed_s"] = time.perf_counter() - t_start
        result.steps.append(step)
        result.losses.append(row["loss"])
        if rank == 0:
            log_row(loop, metrics_path, row)
            bar.update(1)
            # rss: the process's resident memory (noisy, allocator caches); peak: the exact live-tensor peak
            mem = {"peak": f"{row['peak_alloc_mb']:.0f}MB"} if "peak_alloc_mb" in row else {}
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", **mem,
                            rss=f"{row['peak_mem_mb']:.0f}MB")
        stop_if_diverged(loop, step)
        every = cfg.checkpoint.every
        if every and (step % every == 0 or step == cfg.max_steps):  # the last step too: resumable, exportable
            _save_checkpoint(loop, step, prep.data)
        maybe_eval(loop, result, metrics_path, step)
        maybe_fault(step, rank, loop.world)
    bar.close()
    return step


def _start_line(loop: Loop, n_examples: int, start_step: int) -> str:
    """One line before the first step (also with progress: false): mesh, data, features, where it starts."""
    cfg, m = loop.cfg, loop.cfg.memory
    features = [name for name, on in (("lora", _lora(loop)), ("fsdp", bool(cfg.fsdp)), ("fused_loss", m.fused_loss),
                                       ("activation_checkpointing", m.activation_checkpointing),
                                       ("offload_activations", m.offload_activations), ("tiled_mlp", m.tiled_mlp),
                                       ("memory.measure", m.measure)) if on]
    unit = "packed rows" if cfg.dataset.packing else ("prompts" if cfg.stage == "grpo" else "examples")
    where = f"resuming at step {start_step}" if start_step else "from step 0"
    mesh = repr(loop.mesh)
    if loop.dynamic is not None:
        m = loop.dynamic.meshes
        mesh = (f"length-aware SP, degrees {'/'.join(str(d) for d in m.degrees)} (largest: {loop.mesh!r}), "
                f"max_local_tokens {cfg.sequence_parallel.max_local_tokens}")
    return (f"[seqpar] {cfg.stage} {cfg.precision}: {mesh}, world {loop.world}; {n_examples} {unit}; "
            f"{cfg.max_steps} steps {where}; features: {', '.join(features) or 'none'}")


def _lora(loop: Loop) -> bool:
    return loop.cfg.finetuning.method == "lora"


def _state_model(loop: Loop) -> torch.nn.Module:
    """What checkpoints hold: the fp32 masters under bf16 without FSDP, else the model."""
    return loop.prec.module if loop.prec else loop.model


def _save_checkpoint(loop: Loop, step: int, data: DataIdentity) -> None:
    cfg, m = loop.cfg, loop.mesh
    rows = loop.streams[0].rows  # every slot's stream is at the same global row between steps
    state = {"step": step, "scheduler": loop.scheduler.state_dict(), "data": {"rows": rows}}
    layout = RunLayout.of(cfg, loop.world, m.ulysses_degree, m.ring_degree, dp=m.dp_size * len(loop.streams),
                          sp=m.sp_size)
    save_checkpoint(loop.out, step, _state_model(loop), loop.optimizer, state, trainable_only=_lora(loop),
                    keep_last=cfg.checkpoint.keep_last,
                    run_meta=run_meta(cfg, loop.world, layout, rows, data))


def stop_if_diverged(loop: Loop, step: int) -> None:
    """After max_consecutive_nonfinite skipped steps in a row, stop (exit code 1 from the CLI)."""
    n = loop.cfg.max_consecutive_nonfinite
    if loop.nonfinite_streak >= n:
        where = latest_checkpoint(loop.out)
        raise TrainingDiverged(
            f"{n} consecutive steps (up to step {step}) had a non-finite loss or gradient norm and were skipped: "
            f"lower optimizer.lr, set optimizer.max_grad_norm, or check the data; last checkpoint: "
            f"{where if where is not None else 'none'}"
        )


def export_final(loop: Loop, tok: Any, result: TrainResult, step: int) -> None:
    """<output_dir>/final/: the model in HF format + tokenizer (export.final); a collective under FSDP."""
    cfg = loop.cfg
    if cfg.export.final:
        path = export_trained(loop.model, cfg, tok, loop.out / "final", merge_lora=cfg.export.merged_lora, step=step)
        result.export_path = str(path) if path is not None else None


def finish(loop: Loop, result: TrainResult, metrics_path: Path) -> None:
    """Final state (when asked), the loss plot, and a last barrier so no rank leaves early."""
    cfg = loop.cfg
    if cfg.checkpoint.save_final:
        state = full_model_state(_state_model(loop), trainable_only=_lora(loop))
        if loop.rank == 0:
            path = loop.out / "final_state.pt"
            torch.save(state, path)
            result.final_state_path = str(path)
    if loop.rank == 0:
        rows = read_metrics(metrics_path)
        curves = {f"{cfg.stage} loss": [(m["step"], m["loss"]) for m in rows if "loss" in m]}
        if loop.eval_examples is not None:
            curves["eval loss"] = [(m["step"], m["eval_loss"]) for m in rows if "eval_loss" in m]
        m = loop.mesh
        title = (f"seqpar {cfg.stage}: {cfg.model.name}\nsp={m.sp_size} (ulysses {m.ulysses_degree} x ring "
                 f"{m.ring_degree}, {m.effective_layout}), dp={m.dp_size}, world {loop.world}")
        result.plot_path = str(plot_curves(curves, loop.out / "loss.png", title=title))
    if loop.tensorboard is not None:
        loop.tensorboard.close()
    if loop.world > 1:
        dist.barrier()
