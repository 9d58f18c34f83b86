"""The plain, explicit training loop behind `seqpar train` (SFT and DPO, full or LoRA, SP, FSDP2).

    cfg = seqpar.train.config.load_config("cfg.yaml")
    result = seqpar.train.trainer.train(cfg)      # under torchrun, or a single process

Order of work: config checks, model / tokenizer / dataset loading and every check that needs them
run BEFORE the process group exists (a bad config fails identically on every rank, nothing hangs);
then the SP mesh, sequence-parallel attention, LoRA, FSDP2, optimizer, resume, and the loop.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from .. import loss as L
from ..data import SequenceParallelCollator, SequenceParallelDPOCollator, SequenceParallelSampler
from ..errors import SeqParError, TrainingDiverged
from ..hf.vision import is_vlm
from ..memory.fused_loss import install_fused_head
from ..memory.meter import PeakMemoryMeter
from ..mesh import init_mesh, needs_full_sequence
from .checkpoint import full_model_state, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import DatasetSpec, TrainConfig, validate_for_launch, with_total_steps
from .datasets import ByteTokenizer, HFTokenizer, build_examples, describe_stats, load_chat_template, load_rows
from .evaluation import evaluate
from .grads import fault_grad_scale, maybe_dump_grads
from .grpo import GRPORollout, describe_prompt_stats, grpo_reference, grpo_step_spec, load_prompts
from .images import VisionCollator, VisionSpec, build_vision_examples
from .lock import OutputDirLock
from .model_checks import check_model
from .precision import MasterWeights
from .resume import find_resume, run_meta
from .steps import ReferenceLogps, StepSpec, count_items, micro_batch_loss

__all__ = ["train", "TrainResult", "load_model", "load_tokenizer", "load_model_and_tokenizer", "model_heads",
           "prepare_examples", "FAULT_ENV"]

# Test-only fault injection: the rank SEQPAR_FAULT_RANK (default: the last) exits right after
# optimizer step SEQPAR_FAULT_AFTER_STEP, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0).
FAULT_ENV = "SEQPAR_FAULT_AFTER_STEP"


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


# ----------------------------------------------------------------------------- model + tokenizer
def _model_kind(cfg: TrainConfig) -> str:
    name = cfg.model.name
    if name.startswith("tiny:"):
        from ..hf import ARCHS, HYBRID_ARCHS, VLM_ARCHS

        arch = name.split(":", 1)[1]
        if arch not in ARCHS + HYBRID_ARCHS + VLM_ARCHS:
            raise SeqParError(f"model.name={name!r}: unknown tiny architecture {arch!r}: use "
                              f"tiny:<{'|'.join(ARCHS + HYBRID_ARCHS + VLM_ARCHS)}>")
        return "tiny"
    if name.lower() in SMOLLM2_NAMES:
        return "smollm2"
    return "hf"


SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")
SMOLLM2_HEADS = (9, 3)  # SmolLM2-135M: 9 query heads, 3 kv heads


def _unknown_model(name: str, e: Exception) -> SeqParError:
    return SeqParError(
        f"model.name={name!r} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:160]}): use a "
        f"local model directory, a cached hub id, 'smollm2' (bundled SmolLM2-135M-Instruct) or 'tiny:<arch>'"
    )


def _tiny_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    kwargs = dict(cfg.model.kwargs)
    kwargs.setdefault("vocab_size", ByteTokenizer.vocab_size)
    if kwargs["vocab_size"] < ByteTokenizer.vocab_size:
        raise SeqParError(
            f"tiny models use a byte tokenizer of {ByteTokenizer.vocab_size} ids: set model.kwargs.vocab_size >= "
            f"{ByteTokenizer.vocab_size}"
        )
    return kwargs


def _model_config(cfg: TrainConfig) -> Any:
    """The model's HF config alone (no weights loaded); None for the bundled SmolLM2."""
    kind = _model_kind(cfg)
    if kind == "tiny":
        from ..hf import tiny_config

        kw = {k: v for k, v in _tiny_kwargs(cfg).items() if k not in ("seed", "dtype", "attn_implementation")}
        return tiny_config(cfg.model.name.split(":", 1)[1], **kw)
    if kind == "smollm2":
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model.name)
    except (OSError, ValueError) as e:
        raise _unknown_model(cfg.model.name, e) from None


def model_heads(cfg: TrainConfig) -> tuple[int | None, int | None]:
    """(num_heads, num_kv_heads) from the model's config alone (no weights loaded)."""
    c = _model_config(cfg)
    if c is None:
        return SMOLLM2_HEADS
    c = c.text_config if is_vlm(c) else c  # vision-language models: the decoder's heads
    h = int(c.num_attention_heads)
    return h, int(getattr(c, "num_key_value_heads", None) or h)


def model_needs_full_sequence(cfg: TrainConfig) -> bool:
    """Linear-attention layers (Qwen3-Next / Qwen3.5): automatic SP degrees are pure Ulysses."""
    c = _model_config(cfg)
    return c is not None and needs_full_sequence(c)


def load_tokenizer(cfg: TrainConfig) -> Any:
    kind = _model_kind(cfg)
    template = cfg.dataset.chat_template
    if kind == "tiny":
        if template is not None:
            raise SeqParError("dataset.chat_template needs an HF tokenizer; tiny models use a byte tokenizer: drop it")
        return ByteTokenizer()
    template = load_chat_template(template) if template is not None else None
    if kind == "smollm2":
        from ..hf import load_smollm2_tokenizer

        return HFTokenizer(load_smollm2_tokenizer(), template)
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name), template)
    except (OSError, ValueError) as e:
        raise _unknown_model(cfg.model.tokenizer or cfg.model.name, e) from None


def load_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model in fp32 (see _run for bf16). Tiny models are seeded by cfg.seed."""
    kind = _model_kind(cfg)
    if kind == "tiny":
        from ..hf import tiny_model

        kwargs = _tiny_kwargs(cfg)
        kwargs.setdefault("seed", cfg.seed)
        return tiny_model(cfg.model.name.split(":", 1)[1], **kwargs)
    if kind == "smollm2":
        from ..hf import load_smollm2

        return load_smollm2(**cfg.model.kwargs)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vlm(_model_config(cfg)) else AutoModelForCausalLM
    try:
        return auto.from_pretrained(cfg.model.name, dtype=torch.float32, **cfg.model.kwargs)
    except (OSError, ValueError) as e:
        raise _unknown_model(cfg.model.name, e) from None


def load_model_and_tokenizer(cfg: TrainConfig) -> tuple[torch.nn.Module, Any]:
    return load_model(cfg), load_tokenizer(cfg)


def prepare_examples(cfg: TrainConfig, tok: Any = None, spec: DatasetSpec | None = None) -> tuple[list, dict[str, int]]:
    """Tokenized (and packed) examples of `spec` (default: cfg.dataset) + stats; every dataset check runs here."""
    tok = tok if tok is not None else load_tokenizer(cfg)
    if cfg.stage == "grpo" and spec is None:
        return load_prompts(cfg, tok)  # prompt rows (train/grpo.py)
    d = spec if spec is not None else cfg.dataset
    rows = load_rows(d.path)
    mc = _model_config(cfg)
    if is_vlm(mc):
        return _vision_examples(cfg, d, rows, tok, mc)
    return build_examples(rows, d.format, cfg.stage, tok, d.max_length, d.packing, train_on_prompt=d.train_on_prompt,
                          mask_history=d.mask_history, max_prompt_length=d.max_prompt_length,
                          truncation_mode=d.truncation_mode)


def _vision_examples(cfg: TrainConfig, d: DatasetSpec, rows: list, tok: Any, mc: Any) -> tuple[list, dict[str, int]]:
    """Chat rows with images for a vision-language model (train.images); SFT without packing only."""
    if cfg.stage != "sft" or d.packing:
        raise SeqParError(f"vision-language models train with stage: sft and dataset.packing: false here (got "
                          f"stage {cfg.stage!r}, packing {d.packing}): DPO / GRPO / packed rows with images are "
                          "not supported")
    spec = VisionSpec.from_model_config(mc, cfg.model.name)
    return build_vision_examples(rows, d.format, tok, spec, d.max_length, os.path.dirname(os.path.abspath(d.path)),
                                 train_on_prompt=d.train_on_prompt, mask_history=d.mask_history)


def _heads(model: torch.nn.Module) -> tuple[int, int]:
    c = model.config.text_config if is_vlm(model.config) else model.config
    h = int(c.num_attention_heads)
    return h, int(getattr(c, "num_key_value_heads", None) or h)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


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


def _lr_lambda(cfg: TrainConfig):
    total, kind = cfg.max_steps, cfg.schedule.name
    warm = cfg.schedule.warmup(total)

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        return 1.0 - frac if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return f


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _maybe_fault(step: int, rank: int, world: int) -> None:
    at = os.environ.get(FAULT_ENV)
    if at is None or int(at) != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if rank == int(os.environ.get("SEQPAR_FAULT_RANK", world - 1)):
        print(f"[seqpar] fault hook: rank {rank} exits after step {step}", flush=True)
        os._exit(13)


# ----------------------------------------------------------------------------- the loop
def _quiet_non_main_ranks() -> None:
    """One rank talks: other ranks' HF/datasets progress bars and info logs are noise (errors still show)."""
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")  # raised inside peft
    if int(os.environ.get("RANK", "0")) == 0:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def train(cfg: TrainConfig, *, emulate_dp: int = 1) -> TrainResult:
    """Train per `cfg`. Launch under torchrun for several ranks (or call inside an initialised group).

    emulate_dp: used by `seqpar verify` for the single-process reference: one process plays `emulate_dp`
    dp ranks (same rows per step, same micro-batches, same global normalisation) with SP=1.
    """
    pg_ready = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if pg_ready else int(os.environ.get("WORLD_SIZE", "1"))
    if emulate_dp > 1 and (world != 1 or cfg.sequence_parallel.size != 1):
        raise SeqParError("emulate_dp is for single-process SP=1 references only")

    _quiet_non_main_ranks()
    # 1. Everything that can fail on the config, before any process group exists.
    nh, nkv = model_heads(cfg)
    u, r = validate_for_launch(cfg, world, num_heads=nh, num_kv_heads=nkv, ulysses_only=model_needs_full_sequence(cfg))
    tok = load_tokenizer(cfg)
    if cfg.stage == "grpo" and emulate_dp > 1:
        raise SeqParError("stage: grpo has no emulated-dp reference (seqpar verify): compare runs with dp=1 instead")
    examples, data_stats = prepare_examples(cfg, tok)
    eval_data = prepare_examples(cfg, tok, cfg.eval_dataset) if cfg.eval_dataset is not None else None
    cfg = with_total_steps(cfg, len(examples), emulate_dp if emulate_dp > 1 else world // cfg.sequence_parallel.size)
    check_model(cfg, examples)
    find_resume(cfg, world)  # refuses a checkpoint of a different run (reads files only: same on every rank)
    torch.manual_seed(cfg.seed)
    model = load_model(cfg)
    if _heads(model) != (nh, nkv):
        raise SeqParError(f"model has heads {_heads(model)} but its config said {(nh, nkv)}")
    _check_memory_features(cfg, model, on_accelerator=torch.cuda.is_available())

    # 2. Distributed setup.
    use_cuda = torch.cuda.is_available()
    created_pg = False
    if world > 1 and not pg_ready:
        _init_process_group("nccl" if use_cuda else "gloo")
        created_pg = True
    elif cfg.fsdp and not pg_ready:
        # FSDP2 needs a process group even on one rank (the bf16 reference of `seqpar verify` uses this).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created_pg = True
    rank = dist.get_rank() if world > 1 else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    lock = _take_lock(cfg, world, rank)
    try:
        return _run(cfg, model, tok, examples, data_stats, world, rank, device, u, r, emulate_dp, eval_data)
    finally:
        if lock is not None:
            lock.release()
        if created_pg:
            dist.destroy_process_group()


def _take_lock(cfg: TrainConfig, world: int, rank: int) -> OutputDirLock | None:
    """Rank 0 locks output_dir; its outcome is the first collective, so every rank stops alike."""
    lock = OutputDirLock(cfg.output_dir) if rank == 0 else None
    err = None
    if lock is not None:
        try:
            lock.acquire()
        except SeqParError as e:
            err = str(e)
    if world > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        err = comm.broadcast_object(err, 0, device)
    if err is not None:
        raise SeqParError(err)
    return lock


@dataclass
class _Loop:
    """What the loop's pieces share: built once by _run, read by _train_step / _log_step."""

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
    rollout: GRPORollout | None = None  # stage: grpo: builds each step's micro-batches (train/grpo.py)


def _build_model(cfg: TrainConfig, model: torch.nn.Module, mesh: Any, device: torch.device,
                 world: int) -> tuple[torch.nn.Module, Any, MasterWeights | None]:
    """SP attention, LoRA, memory features (docs/memory.md) and FSDP2 on the model, in that order; the DPO
    reference when the stage needs one; the fp32 master weights of bf16 mixed precision without FSDP."""
    from ..hf import apply_sequence_parallel

    lora = cfg.finetuning.method == "lora"
    needs_ref = (cfg.stage == "dpo" and cfg.dpo.loss_type != "simpo") or (cfg.stage == "grpo" and cfg.grpo.beta > 0)
    bf16 = cfg.precision != "fp32"
    # bf16: fp32 master weights + bf16 compute: with FSDP2 its MixedPrecisionPolicy (fp32 gradient
    # reduction), without FSDP MasterWeights (train/precision.py: taken from the fp32 weights, then the
    # model is cast to bf16 below). bf16-pure: the weights themselves are bf16. Not autocast: under
    # autocast RoPE promotes q/k to fp32 while v stays bf16, and the SP attention requires one dtype.
    model.to(device=device, dtype=torch.bfloat16 if cfg.precision == "bf16-pure" else None)
    ref_model = None
    if needs_ref and not lora:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if bf16:
            ref_model.to(torch.bfloat16)
        apply_sequence_parallel(ref_model, mesh)
    apply_sequence_parallel(model, mesh)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(cfg.seed)  # LoRA A init: identical on every rank and in the SP=1 reference
        f = cfg.finetuning
        model = get_peft_model(
            model, LoraConfig(r=f.r, lora_alpha=f.alpha, lora_dropout=f.dropout, target_modules=f.targets, bias="none")
        )
    _apply_memory_features(cfg, model, ref_model)
    model.train()
    prec = None
    if cfg.precision == "bf16" and not cfg.fsdp:
        prec = MasterWeights(model)
        model.to(torch.bfloat16)
    if cfg.fsdp:
        _apply_fsdp(model, device, world, cfg.precision == "bf16", offload=cfg.fsdp.offload)
    if cfg.memory.fused_loss:  # refuses an architecture it cannot fuse now, before any collective
        for m in (model, ref_model):
            if m is not None:
                install_fused_head(m)
    reference = None
    if needs_ref:
        # Full fine-tuning: the frozen copy; LoRA: the policy itself with the adapter disabled.
        fused = dict(fused_loss=cfg.memory.fused_loss, loss_chunk_tokens=cfg.memory.loss_chunk_tokens)
        if cfg.stage == "grpo":
            reference = grpo_reference(cfg, ref_model, model)
        else:
            reference = (ReferenceLogps(mesh, ref_model=ref_model, **fused) if ref_model is not None
                         else ReferenceLogps(mesh, policy=model, **fused))
    return model, reference, prec


def _check_memory_features(cfg: TrainConfig, model: torch.nn.Module, on_accelerator: bool) -> None:
    """Memory options that cannot work here fail before the process group (identically on every rank)."""
    from ..memory.checkpointing import refuse_offload_on_cpu
    from ..memory.tiled_mlp import decoder_mlps

    if cfg.memory.offload_activations:
        refuse_offload_on_cpu("memory.offload_activations", on_accelerator)
    if cfg.fsdp.offload:
        refuse_offload_on_cpu("fsdp.offload (FSDP2 CPUOffloadPolicy)", on_accelerator)
    if cfg.memory.tiled_mlp:
        decoder_mlps(model)  # raises for MLPs it cannot tile


def _apply_memory_features(cfg: TrainConfig, model: torch.nn.Module, ref_model: torch.nn.Module | None) -> None:
    """Layer checkpointing and tiled MLP: after SP attention and LoRA, before FSDP2 (docs/memory.md)."""
    from ..memory.checkpointing import enable_activation_checkpointing
    from ..memory.tiled_mlp import apply_tiled_mlp

    m = cfg.memory
    if m.activation_checkpointing:
        enable_activation_checkpointing(model, offload=m.offload_activations)
    if m.tiled_mlp:
        for target in (model, ref_model):  # the frozen reference gains the lower forward peak too
            if target is not None:
                apply_tiled_mlp(target, m.tiled_mlp)


def _apply_fsdp(model: torch.nn.Module, device: torch.device, world: int, bf16: bool, offload: bool = False) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:  # refused on CPU-only runs before the process group (_check_memory_features); untested here
        kw["offload_policy"] = CPUOffloadPolicy()
    # FSDP2 over the flattened dp x sp world: every rank holds 1/world of the parameters.
    fmesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_sp",))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=fmesh, **kw)
    fully_shard(model, mesh=fmesh, **kw)


def _build_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    o = cfg.optimizer
    if o.name == "adamw":
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    else:
        optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))


def _build_data(cfg: TrainConfig, mesh: Any, tok: Any, n_examples: int, emulate_dp: int) -> tuple[list, Any]:
    """One row stream per dp slot this process plays (1, or emulate_dp in the SP=1 reference), and the collator."""
    slots = [(mesh.dp_size, mesh.dp_rank)] if emulate_dp == 1 else [(emulate_dp, d) for d in range(emulate_dp)]
    streams = [
        DataStream(SequenceParallelSampler(n_examples, n, d, shuffle=cfg.dataset.shuffle, seed=cfg.seed))
        for n, d in slots
    ]
    return streams, _make_collator(cfg, mesh, tok, cfg.dataset)


def _make_collator(cfg: TrainConfig, mesh: Any, tok: Any, ds: DatasetSpec) -> Any:
    if cfg.stage == "dpo":
        return SequenceParallelDPOCollator(mesh, tok.pad_token_id, max_length=ds.max_length)
    mc = _model_config(cfg)
    kind = VisionCollator if is_vlm(mc) else SequenceParallelCollator
    return kind(mesh, tok.pad_token_id, packing=ds.packing, max_length=ds.max_length)


def _run(cfg: TrainConfig, model: torch.nn.Module, tok: Any, examples: list, data_stats: dict, world: int, rank: int,
         device: torch.device, u: int, r: int, emulate_dp: int,
         eval_data: tuple[list, dict] | None = None) -> TrainResult:
    mesh = init_mesh(cfg.sequence_parallel.size, ulysses_degree=u, ring_degree=r, layout=cfg.sequence_parallel.layout)
    lora = cfg.finetuning.method == "lora"
    model, reference, prec = _build_model(cfg, model, mesh, device, world)
    params = prec.masters if prec else [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = _build_optimizer(cfg, params)
    streams, collator = _build_data(cfg, mesh, tok, len(examples), emulate_dp)
    out = Path(cfg.output_dir)
    loop = _Loop(cfg, mesh, model, params, optimizer, scheduler, streams, collator, examples,
                 StepSpec(cfg.stage, cfg.dpo.beta, cfg.dpo.loss_type, cfg.dpo.gamma, cfg.memory.fused_loss,
                          cfg.memory.loss_chunk_tokens), reference, device, world, rank,
                 out, factor=(L.gradient_reduction_factor(mesh) if cfg.fsdp else 1.0) * fault_grad_scale(world),
                 prec=prec, eval_examples=eval_data[0] if eval_data else None,
                 eval_collator=_make_collator(cfg, mesh, tok, cfg.eval_dataset) if eval_data else None)
    state_model = prec.module if prec else model  # what checkpoints hold: the fp32 masters under bf16
    if cfg.memory.measure:
        # CUDA: the allocator's exact peak, without the tracker's per-op Python cost (no split by category).
        extra = (getattr(reference, "ref_model", None), prec.module if prec else None)
        loop.meter = PeakMemoryMeter(model, optimizer, device, extra=extra,
                                     categories=device.type != "cuda")

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if world > 1:
        dist.barrier()
    metrics_path = out / "metrics.jsonl"
    start_step, resumed_from = 0, None
    ckpt = _resume_point(cfg, world, rank, out)
    if ckpt is not None:
        state = load_checkpoint(ckpt, state_model, optimizer, trainable_only=lora)
        if prec:
            prec.masters_to_model()
        start_step = resumed_from = int(state["step"])
        scheduler.load_state_dict(state["scheduler"])
        for s, st in zip(streams, state["data"]):
            s.load_state_dict(st)
    if cfg.stage == "grpo":
        loop.spec, loop.rollout = grpo_step_spec(cfg), GRPORollout(cfg, mesh, tok, examples, collator)
    if rank == 0:
        _trim_metrics(metrics_path, start_step)
        if start_step == 0:
            (out / "config.json").write_text(cfg.model_dump_json(indent=2))
        (out / "mesh.txt").write_text(f"{mesh!r} world={world}\n")

    result = TrainResult(output_dir=str(out), resumed_from=resumed_from, metrics_path=str(metrics_path),
                         world_size=world, mesh=repr(mesh))
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=(rank != 0 or not cfg.progress),
               desc=f"{cfg.stage} sp={mesh.sp_size} dp={mesh.dp_size}", dynamic_ncols=True)
    _report_data_stats(cfg, rank, data_stats, eval_data[1] if eval_data else None)
    loop.tensorboard = _open_tensorboard(cfg, rank, out)
    step = start_step
    t_start = time.perf_counter()
    while step < cfg.max_steps:
        row = _measured_step(loop, step)
        if loop.meter is not None:
            result.peak_alloc.append(loop.meter.last)
        step += 1
        row["elapsed_s"] = time.perf_counter() - t_start
        result.steps.append(step)
        result.losses.append(row["loss"])
        if rank == 0:
            _log_row(loop, metrics_path, row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            mem=f"{row['peak_mem_mb']:.0f}MB")
        _stop_if_diverged(loop, step)
        every = cfg.checkpoint.every
        if every and step % every == 0 and step < cfg.max_steps:
            state = {"step": step, "scheduler": scheduler.state_dict(), "data": [s.state_dict() for s in streams]}
            save_checkpoint(out, step, state_model, optimizer, state, trainable_only=lora,
                            keep_last=cfg.checkpoint.keep_last, run_meta=run_meta(cfg, world))
        _maybe_eval(loop, result, metrics_path, step)
        _maybe_fault(step, rank, world)
    bar.close()
    _export_final(loop, tok, result, step)
    _finish(loop, result, metrics_path)
    return result


def _report_data_stats(cfg: TrainConfig, rank: int, stats: dict, eval_stats: dict | None) -> None:
    """Rank 0 prints what the data pipeline truncated or dropped (rows are never changed silently)."""
    if rank != 0:
        return
    lines = (describe_prompt_stats(stats, cfg.grpo.max_prompt_length) if cfg.stage == "grpo"
             else describe_stats(stats, cfg.dataset.max_length))
    if eval_stats is not None:
        lines += describe_stats(eval_stats, cfg.eval_dataset.max_length, "eval_dataset")
    for line in lines:
        print(f"[seqpar] {line}", flush=True)


def _open_tensorboard(cfg: TrainConfig, rank: int, out: Path) -> Any:
    if rank != 0 or "tensorboard" not in cfg.report_to:
        return None
    from torch.utils.tensorboard import SummaryWriter  # needs `pip install tensorboard` (checked at launch)

    return SummaryWriter(log_dir=str(out / "tensorboard"))


def _log_row(loop: _Loop, metrics_path: Path, row: dict[str, Any]) -> None:
    """Rank 0: one metrics.jsonl row, and its numbers as TensorBoard scalars when asked."""
    with open(metrics_path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    if loop.tensorboard is not None:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                loop.tensorboard.add_scalar(f"{'eval' if k.startswith('eval_') else 'train'}/{k}", v, row["step"])
        loop.tensorboard.flush()


def _maybe_eval(loop: _Loop, result: TrainResult, metrics_path: Path, step: int) -> None:
    """Eval every cfg.eval_every steps and after the last one (all ranks; rank 0 logs)."""
    cfg = loop.cfg
    if loop.eval_examples is None:
        return
    if not (step == cfg.max_steps or (cfg.eval_every and step % cfg.eval_every == 0)):
        return
    t0 = time.perf_counter()
    ev = cfg.eval_dataset
    loss, items = evaluate(loop.model, loop.eval_examples, loop.eval_collator, loop.mesh, loop.spec, loop.reference,
                           rows_per_batch=cfg.micro_batch_size, packing=ev.packing)
    result.eval_losses.append((step, loss))
    if loop.rank == 0:
        _log_row(loop, metrics_path, {"step": step, "eval_loss": loss, "eval_items": items,
                                      "eval_s": time.perf_counter() - t0})


def _resume_point(cfg: TrainConfig, world: int, rank: int, out: Path) -> Path | None:
    """The checkpoint to resume from (announced), or None; a fresh start forgets older checkpoints' marker."""
    found = find_resume(cfg, world)
    if found is None:
        if rank == 0 and latest_checkpoint(out) is not None:
            (out / "latest").unlink()  # checkpoint.resume: false: a later resume must not pick the old run's
        return None
    if rank == 0:
        print(f"[seqpar] resuming from step {found[1]}: {found[0]}", flush=True)
    return found[0]


def _next_micro_batches(loop: _Loop) -> list[dict[str, torch.Tensor]]:
    cfg = loop.cfg
    rows_per_micro = 1 if cfg.dataset.packing else cfg.micro_batch_size
    micro: list[dict[str, torch.Tensor]] = []
    for stream in loop.streams:
        for _ in range(cfg.grad_accum):
            idx = stream.take(rows_per_micro)
            batch_rows = loop.examples[idx[0]] if cfg.dataset.packing else [loop.examples[i] for i in idx]
            micro.append(loop.collator(batch_rows))
    return micro


def _train_step(loop: _Loop, step: int, prepared: tuple[list, dict] | None = None) -> dict[str, Any]:
    """One optimizer step (all micro-batches of every dp slot this process plays); returns its metrics row.
    prepared: (micro-batches, extra metrics) built beforehand (stage: grpo, see _measured_step)."""
    cfg, mesh = loop.cfg, loop.mesh
    t0 = time.perf_counter()
    micro, rollout_metrics = prepared if prepared is not None else (_next_micro_batches(loop), {})
    # Global denominator first: all micro-batches of the step, then over dp (pitfalls 4 and 5).
    num_items = L.global_token_count(count_items(micro, cfg.stage), mesh)
    share_sum = torch.zeros((), dtype=torch.float32)
    dpo_metrics: dict[str, float] = {}
    for j, b in enumerate(micro):
        if cfg.fsdp:
            loop.model.set_requires_gradient_sync(j == len(micro) - 1)
        share, met = micro_batch_loss(loop.model, b, num_items, mesh, loop.spec, loop.reference)
        (share * loop.factor).backward()
        share_sum += share.detach().float().cpu()
        for k, v in met.items():
            dpo_metrics[k] = dpo_metrics.get(k, 0.0) + float(v) / len(micro)
    if loop.prec:
        loop.prec.grads_to_masters()
    if not cfg.fsdp:
        L.sum_gradients(loop.params, mesh)
    maybe_dump_grads(loop.model, loop.params, step, loop.rank)  # for `seqpar verify` (env-triggered)
    o = cfg.optimizer
    max_norm = o.max_grad_norm if o.max_grad_norm is not None else float("inf")
    gnorm = torch.nn.utils.clip_grad_norm_(loop.params, max_norm)
    gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    loss_val = float(L.global_loss(share_sum, mesh))
    finite = _apply_update(loop, loss_val, float(gnorm))
    tokens = int(L.global_token_count(sum(int(b["num_input_tokens"]) for b in micro), mesh))
    stats = [_peak_memory_mb(loop.device)]
    if loop.world > 1:
        # Host-side numbers travel on the mesh's communication device (NCCL refuses CPU tensors).
        stats = comm.all_reduce_values(stats, dist.group.WORLD, mesh.comm_device, op=dist.ReduceOp.MAX).tolist()
        if dpo_metrics:
            mt = comm.all_reduce_values(list(dpo_metrics.values()), mesh.dp_group, mesh.comm_device)
            dpo_metrics = dict(zip(dpo_metrics, (mt / mesh.dp_size).tolist()))
    dt = time.perf_counter() - t0
    return {"step": step + 1, "loss": loss_val, "lr": loop.scheduler.get_last_lr()[0], "grad_norm": float(gnorm),
            "tokens": tokens, "supervised": int(num_items.reshape(-1)[-1]), "tokens_per_s": tokens / dt,
            "step_s": dt, "peak_mem_mb": float(stats[0]), "nonfinite": int(not finite), **dpo_metrics,
            **rollout_metrics}


def _apply_update(loop: _Loop, loss: float, grad_norm: float) -> bool:
    """Optimizer + scheduler step, unless the loss or gradient norm is NaN/inf: then the gradients are
    dropped and the parameters stay as they are (the scheduler still advances: lr stays a function of
    the step number). Both values are global, so every rank decides alike. Returns whether it updated."""
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        loop.optimizer.step()
        if loop.prec:
            loop.prec.masters_to_model()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)
    loop.nonfinite_streak = 0 if finite else loop.nonfinite_streak + 1
    return finite


def _stop_if_diverged(loop: _Loop, step: int) -> None:
    """After max_consecutive_nonfinite skipped steps in a row, stop (exit code 1 from the CLI)."""
    n = loop.cfg.max_consecutive_nonfinite
    if loop.nonfinite_streak >= n:
        where = latest_checkpoint(loop.out)
        raise TrainingDiverged(
            f"{n} consecutive steps (up to step {step}) had a non-finite loss or gradient norm and were skipped: "
            f"lower optimizer.lr, set optimizer.max_grad_norm, or check the data; last checkpoint: "
            f"{where if where is not None else 'none'}"
        )


def _export_final(loop: _Loop, tok: Any, result: TrainResult, step: int) -> None:
    """<output_dir>/final/: the model in HF format + tokenizer (export.final); a collective under FSDP."""
    cfg = loop.cfg
    if cfg.export.final:
        from .export import export_trained

        path = export_trained(loop.model, cfg, tok, loop.out / "final", merge_lora=cfg.export.merged_lora, step=step)
        result.export_path = str(path) if path is not None else None


def _measured_step(loop: _Loop, step: int) -> dict[str, Any]:
    """_train_step inside the memory meter (memory.measure): adds peak_alloc_mb, the max over ranks.
    stage: grpo: generation and rewards run first, outside the meter (its module hooks are for training)."""
    prepared = None
    if loop.rollout is not None:
        t0 = time.perf_counter()
        prepared = loop.rollout.step_batches(loop.model, loop.streams[0], step)
        prepared[1]["rollout_s"] = time.perf_counter() - t0
    if loop.meter is None:
        return _train_step(loop, step, prepared)
    with loop.meter.measure():
        row = _train_step(loop, step, prepared)
    peak = [float(loop.meter.last["peak_bytes"])]
    if loop.world > 1:
        peak = comm.all_reduce_values(peak, dist.group.WORLD, loop.mesh.comm_device, op=dist.ReduceOp.MAX).tolist()
    row["peak_alloc_mb"] = float(peak[0]) / 2**20
    return row


def _finish(loop: _Loop, result: TrainResult, metrics_path: Path) -> None:
    """Final state (when asked), the loss plot, and a last barrier so no rank leaves early."""
    cfg = loop.cfg
    if cfg.checkpoint.save_final:
        state = full_model_state(loop.prec.module if loop.prec else loop.model,
                                 trainable_only=cfg.finetuning.method == "lora")
        if loop.rank == 0:
            path = loop.out / "final_state.pt"
            torch.save(state, path)
            result.final_state_path = str(path)
    if loop.rank == 0:
        from .plots import plot_curves, read_metrics

        rows = read_metrics(metrics_path)
        curves = {f"{cfg.stage} loss ({repr(loop.mesh)})": [(m["step"], m["loss"]) for m in rows if "loss" in m]}
        if loop.eval_examples is not None:
            curves["eval loss"] = [(m["step"], m["eval_loss"]) for m in rows if "eval_loss" in m]
        title = f"seqpar {cfg.stage}: {cfg.model.name}"
        result.plot_path = str(plot_curves(curves, loop.out / "loss.png", title=title))
    if loop.tensorboard is not None:
        loop.tensorboard.close()
    if loop.world > 1:
        dist.barrier()


def _init_process_group(backend: str) -> None:
    """env:// init; after a torchrun restart, under a per-attempt key prefix.

    torchrun's store outlives a failed attempt, and gloo's rendezvous keys do not change between
    attempts: a restarted rank could read the dead rank's address ("connectFullMesh ... Connection
    refused"). A prefix per TORCHELASTIC_RESTART_COUNT keeps each attempt's keys apart.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart == 0:
        dist.init_process_group(backend)
        return
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(backend, store=dist.PrefixStore(f"seqpar_attempt_{restart}", store), rank=rank,
                            world_size=world)


def _trim_metrics(path: Path, keep_upto: int) -> None:
    """Fresh run: start an empty file; resumed run: drop rows logged after the checkpoint."""
    if keep_upto == 0 or not path.exists():
        path.write_text("")
        return
    kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= keep_upto]
    path.write_text("".join(ln + "\n" for ln in kept))
