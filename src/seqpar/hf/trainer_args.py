"""TrainingArguments checks and adjustments of the Trainer drop-ins (seqpar.hf.trainer), done at construction,
identically on every rank, before any collective: what would silently do something else under SP is
refused with a SeqParError naming the alternative."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..data import SequenceParallelCollator
from ..errors import SeqParError
from ..memory.checkpointing import checkpoint_kwargs, drop_input_require_grads, keep_attention_context
from ..memory.offload import install_activation_offload
from .prepare import PrepareSpec, check_memory_features
from .trainer_stack import deepspeed_stage

__all__ = ["BF16_ON_CPU", "refuse_unsupported", "check_memory_args", "drop_input_grads_after_enable",
           "use_cpu_when_no_accelerator", "say_bf16_on_cpu", "has_target", "pad_id", "check_sp_sizes",
           "dataset_columns", "check_dataset_rows"]


def _is_sp_collator(c: Any) -> bool:
    return isinstance(c, SequenceParallelCollator)


def refuse_unsupported(name: str, args: Any, kwargs: dict[str, Any]) -> None:
    """Trainer features that would silently do something else under SP: refuse them (same on every rank)."""
    # compute_metrics / preprocess_logits_for_metrics run under SP (seqpar.hf.trainer_eval); DPO refuses them there.
    include = getattr(args, "include_for_metrics", None) or []
    if kwargs.get("compute_metrics") is not None and "loss" in include:
        raise SeqParError(
            f"{name}: include_for_metrics={include!r}: 'loss' is not supported (the stock Trainer passes each eval "
            "batch's mean loss, repeated per row, which depends on how rows are batched over the ranks): drop "
            "'loss' (eval_loss, seqpar's exact global token mean, is in the returned metrics); 'inputs' is supported"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy in ("group_by_length", "batch_rebalance") or getattr(args, "group_by_length", False):
        raise SeqParError(
            f"{name}: train_sampling_strategy={strategy!r} is not supported (the SP sampler shuffles or keeps the "
            "order; it does not group rows by length): use train_sampling_strategy='random' or 'sequential', "
            "and packing=True to avoid padding waste"
        )
    collator = kwargs.get("data_collator")
    if collator is not None and not _is_sp_collator(collator):
        raise SeqParError(
            f"{name}: data_collator={getattr(collator, '__name__', type(collator).__name__)} is not a seqpar "
            "collator and cannot shard a batch over the SP ranks: drop data_collator= (rows with input_ids and "
            "optional labels, -100 = unsupervised, are collated by seqpar.data.SequenceParallelCollator; use "
            "packing= / max_length= here), or pass a seqpar.data.SequenceParallelCollator yourself; do any "
            "other per-row preprocessing in the dataset (datasets.Dataset.map)"
        )


def check_memory_args(model: torch.nn.Module, args: Any, spec: PrepareSpec) -> None:
    """Checkpointing / tiled-MLP settings seqpar cannot run exactly fail here, on every rank alike.

    The Trainer enables checkpointing itself in train() with args.activation_checkpointing_kwargs (a.k.a.
    gradient_checkpointing_kwargs): we make those non-reentrant with whole-layer recomputes, so its own call
    does what `seqpar train` does (memory.activation_checkpointing).
    """
    check_memory_features(model, spec)  # the same checks as `seqpar train`'s
    # tiled_layer's per-call gathers vs one node's grads: untested (ZeRO-3 from deepspeed= or accelerate's plugin)
    if spec.tiled_layer and deepspeed_stage(args) == 3:
        raise SeqParError("tiled_layer under DeepSpeed ZeRO-3 is not supported: use ZeRO 1/2 or FSDP2 "
                          "(fsdp=...), or tiled_layer=False (tiled_mlp=True works under ZeRO-3)")
    if not getattr(args, "gradient_checkpointing", False):
        if spec.keep_attention:
            raise SeqParError("keep_attention=True keeps attention's outputs through activation checkpointing: "
                              "set gradient_checkpointing=True in the TrainingArguments, or drop keep_attention")
        return
    user = getattr(args, "activation_checkpointing_kwargs", getattr(args, "gradient_checkpointing_kwargs", None))
    if isinstance(user, str):
        raise SeqParError("gradient_checkpointing_kwargs must be a dict here, got a string")
    ck = checkpoint_kwargs(user, zero3=deepspeed_stage(args) == 3)
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if hasattr(args, name):
            setattr(args, name, dict(ck))


def drop_input_grads_after_enable(model: torch.nn.Module, keep_attention: bool = False) -> None:
    """Trainer.train() enables checkpointing on the model, and transformers then adds input-require-grads
    hooks that cost a LoRA run the embedding output's gradient (memory.checkpointing.drop_input_require_grads):
    remove them right after, as `seqpar train` does. keep_attention: the Trainer's checkpoint kwargs get the
    selective-checkpoint contexts that keep the attention kernels' outputs (memory.checkpointing)."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        enable = getattr(model, name, None)
        if callable(enable):
            def enable_then_drop(*a: Any, _enable: Any = enable, **kw: Any) -> Any:
                offload = kw.pop("offload", False)  # seqpar's host store instead of transformers' save_on_cpu
                if keep_attention:
                    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
                        if kw.get(key) is not None:
                            kw[key] = {**kw[key], "context_fn": keep_attention_context}
                out = _enable(*a, **kw)
                drop_input_require_grads(model)
                if offload:
                    install_activation_offload(model)
                return out

            setattr(model, name, enable_then_drop)


def use_cpu_when_no_accelerator(args: Any) -> None:
    """Several ranks and no accelerator: make accelerate use multi-CPU DDP (gloo).

    accelerate picks its MULTI_CPU (DDP over gloo) mode only with `use_cpu=True`; without it, on a
    machine with no GPU it sets up NO distributed training at all, and the model is never wrapped in DDP.
    """
    multi = torch.distributed.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not multi or args.use_cpu or torch.accelerator.current_accelerator() is not None:
        return
    args.use_cpu = True
    # args.device may have been read already: drop the cached device setup so the next read redoes it
    # (TrainingArguments._setup_devices resets accelerate's state itself).
    args.__dict__.pop("_setup_devices", None)


BF16_ON_CPU = ("[seqpar] bf16=True (TRL's default) on a machine without an accelerator: the forward runs under bf16 "
               "autocast, slowly on CPU, and results match fp32 only to bf16 rounding (~1e-2 relative; a padded "
               "batch through stock transformers takes another attention kernel, ~1e-4 apart): pass bf16=False "
               "for fp32")


def say_bf16_on_cpu(args: Any) -> None:
    """One line on the main process when bf16 autocast would run on CPU (TRL configs default to bf16=True)."""
    if getattr(args, "bf16", False) and (args.use_cpu or torch.accelerator.current_accelerator() is None):
        if int(os.environ.get("RANK", "0")) == 0:
            print(BF16_ON_CPU, flush=True)


def has_target(row: Any, max_length: int | None) -> bool:
    """A target exists where labels[t] != -100 for some t >= 1 (the collator shifts on the full row)."""
    labels = row.get("labels") if isinstance(row, dict) else None
    labels = row["input_ids"] if labels is None else labels
    labels = [int(x) for x in (labels.tolist() if hasattr(labels, "tolist") else labels)]
    return any(lab != -100 for lab in labels[1:max_length])


def pad_id(model: torch.nn.Module, tok: Any) -> int:
    """The collators' padding id: the tokenizer's (or the model config's) pad token, else its eos token, else 0."""
    for src in (tok, getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id"):
            v = getattr(src, name, None) if src is not None else None
            if isinstance(v, int) and v >= 0:
                return v
    return 0


def check_sp_sizes(name: str, sequence_parallel_size: Any, ulysses_degree: Any, ring_degree: Any, mesh: Any) -> None:
    """The drop-ins' mesh arguments: None (the default: the world size / automatic degrees) or a positive int; a
    0 must not fall back to the world size. A mesh= and sizes that disagree with it are refused (the mesh wins)."""
    if sequence_parallel_size == "dynamic":
        raise SeqParError(
            f"{name}: sequence_parallel_size='dynamic' (length-aware SP) runs in `seqpar train` only: the Trainer's "
            "data loader gives every dp rank its own fixed micro-batches and its DDP / FSDP / DeepSpeed wrapper "
            "expects the same forwards on every rank of an SP group, while length-aware SP plans each step's rows "
            "over all ranks, in groups whose sizes change per micro-step. Use `seqpar train` with "
            "sequence_parallel: {size: dynamic, max_local_tokens: N} (docs/training.md), or a fixed "
            "sequence_parallel_size here")
    given = (("sequence_parallel_size", sequence_parallel_size, "the world size"),
             ("ulysses_degree", ulysses_degree, "automatic"), ("ring_degree", ring_degree, "automatic"))
    for arg, v, default in given:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise SeqParError(f"{name}: {arg}={v!r}: give a positive int, or leave it unset ({default})")
    if mesh is None:
        return
    have = {"sequence_parallel_size": mesh.sp_size, "ulysses_degree": mesh.ulysses_degree,
            "ring_degree": mesh.ring_degree}
    bad = [f"{arg}={v} (the mesh has {have[arg]})" for arg, v, _ in given if v is not None and v != have[arg]]
    if bad:
        raise SeqParError(f"{name}: mesh= and {', '.join(bad)} disagree: give the mesh alone, or the sizes alone")


def dataset_columns(dataset: Any) -> list[str] | None:
    """A dataset's column names (a datasets.Dataset's, or the keys of a map-style dataset's first row); None when
    they cannot be known without iterating it (an IterableDataset) or it is empty."""
    cols = getattr(dataset, "column_names", None)
    if isinstance(cols, list):
        return cols
    try:
        first = dataset[0] if len(dataset) else None
    except (TypeError, KeyError, IndexError):
        return None
    return sorted(first) if isinstance(first, dict) else None


def check_dataset_rows(name: str, datasets: dict[str, Any], formats: list[tuple[str, ...]], hint: str) -> None:
    """Every given dataset ({"train_dataset": ds, "eval_dataset": ds or a dict of them}) has the columns of one of
    `formats`: a SeqParError naming its columns and `hint` otherwise, raised at construction on every rank alike
    (a missing column used to surface as a KeyError in training, or on one rank while the others waited)."""
    for which, ds in datasets.items():
        for key, one in (ds.items() if isinstance(ds, dict) else [(None, ds)]):
            cols = dataset_columns(one) if one is not None else None
            if cols is None or any(set(f) <= set(cols) for f in formats):
                continue
            what = which if key is None else f"{which}[{key!r}]"
            want = " or ".join(" + ".join(repr(c) for c in f) for f in formats)
            raise SeqParError(f"{name}: {what} has columns {cols}, none of the formats it reads ({want}): {hint}")
