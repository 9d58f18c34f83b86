"""Drop-in `transformers.Trainer` subclasses that train under sequence parallelism.

    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train()                                                              # torchrun --nproc-per-node N

What changes against the stock Trainer (all built on the pieces the plain loop uses, seqpar.steps):
- the model gets seqpar attention (`apply_sequence_parallel`) over a mesh of `sequence_parallel_size`
  ranks (default: the whole world), and the memory features and fused head asked for, through
  `seqpar.hf.prepare_model` (the same preparation as `seqpar train`); data goes through
  `SequenceParallelCollator` (or the DPO one), which shifts labels on the full sequence, keeps global
  position_ids and shards every row;
- the train / eval dataloaders use the SP-aware sampler (every rank of an SP group sees the same
  rows; dp ranks different ones) and are NOT re-sharded by accelerate;
- the loss of each micro-batch is this rank's share of the step's token-mean (denominator: the
  GLOBAL supervised-token count over all grad-accumulation micro-batches and dp ranks; pairs for
  DPO), multiplied by dp x sp because DDP, FSDP2 and DeepSpeed ZeRO AVERAGE gradients over the world
  and our shares need their SUM. The logged "loss" is then exactly the global token-averaged loss;
- the stack the Trainer sets up from TrainingArguments is kept: DDP, FSDP2 (fsdp + fsdp_version 2) and
  DeepSpeed ZeRO 1/2/3 (offload included), each checked to reduce over all dp x sp ranks; a
  parallelism_config becomes seqpar's mesh (seqpar.hf.trainer_stack); ddp_timeout reaches every group;
- evaluate() runs under SP (no full-length forward on one rank) and reports the global
  token-averaged loss, counting every eval row exactly once (no wrap-around padding: a dp rank
  with fewer rows runs discarded padding batches so the collectives stay matched).
- compute_metrics / preprocess_logits_for_metrics and predict() work as with the stock Trainer (SFT):
  preprocess_logits_for_metrics runs per SP shard (it must be per position, e.g. argmax) and its output
  is gathered in sequence order; rows come back in dataset order, -100 past each row's end
  (seqpar.hf.trainer_eval). prediction_step() raises (evaluate() / predict() do not use it).
- refused at init with a SeqParError that names the alternative (they would silently do something
  else under SP): include_for_metrics "loss", compute_metrics / preprocess_logits_for_metrics for
  DPO, train_sampling_strategy "group_by_length" / "batch_rebalance" (the SP sampler does not group
  by length), and a data_collator that is not a seqpar collator (it could not shard the batch).
- on CPU ranks (several ranks, no accelerator) `use_cpu=True` is set on the TrainingArguments:
  accelerate sets up multi-CPU DDP only with it (without it: no distributed training at all);
- resume_from_checkpoint is exact, mid-epoch included (the skipped batches and each epoch's
  shuffle come out as in the uninterrupted run), also from a checkpoint of another world size / SP size /
  dp size with the same global batch (seqpar.hf.trainer_resume: each checkpoint records its layout, a resume
  says what changed, refuses what the Trainer cannot continue exactly); PEFT (LoRA) models train as with the
  stock Trainer.
- `TrainingArguments(gradient_checkpointing=True)` is honoured, made non-reentrant with whole-layer
  recomputes (seqpar.memory.checkpointing.checkpoint_kwargs); `tiled_mlp=True | n` tiles every decoder
  MLP (seqpar.memory.tiled_mlp); gradient_checkpointing_kwargs={"offload": True} keeps the checkpointed layer
  inputs in host memory (seqpar.memory.offload; on CPU too, where the meter shows the device bytes drop).
Rows are dicts with "input_ids" and optional "labels" (-100 = unsupervised); for Qwen2.5-VL / Qwen3-VL also the
processor's "pixel_values" / "image_grid_thw" / "pixel_values_videos" / "video_grid_thw" / "second_per_grid_ts"
(seqpar.data.VisionCollator; FSDP2 units per vision block work: every rank runs the tower); DPO rows hold
"prompt_input_ids", "chosen_input_ids", "rejected_input_ids" (VL models: + the prompt's media, VisionDPOCollator).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader
from transformers import Trainer

from .. import comm
from .. import loss as L
from ..attention.kernel_choice import check_kernel_name
from ..data import (
    SequenceParallelCollator,
    SequenceParallelDPOCollator,
    SequenceParallelSampler,
    VisionCollator,
    VisionDPOCollator,
)
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh, init_mesh
from ..steps import ReferenceLogps, StepSpec, count_items, micro_batch_loss
from .prepare import PrepareSpec, frozen_reference, policy_copy, prepare_model
from .trainer_args import (
    BF16_ON_CPU,
    check_dataset_rows,
    check_memory_args,
    check_sp_sizes,
    drop_input_grads_after_enable,
    has_target,
    pad_id,
    refuse_unsupported,
    say_bf16_on_cpu,
    use_cpu_when_no_accelerator,
)
from .trainer_eval import SequenceParallelEvaluation
from .trainer_resume import check_resume, resolve_checkpoint, write_layout
from .trainer_stack import (
    agree_gathers,
    check_stack_args,
    fsdp_on_cpu,
    is_zero3,
    load_stateless_fsdp_optimizer,
    map_parallelism_config,
    prepare_reference,
    wrapper_factor,
)
from .vision import is_vlm_model

__all__ = ["SequenceParallelTrainer", "SequenceParallelDPOTrainer", "DPOSettings", "BF16_ON_CPU"]


@dataclass(frozen=True)
class DPOSettings:
    """The DPO drop-ins' loss and reference (seqpar's and TRL's): ref_model None = the policy with its PEFT
    adapter disabled, or a frozen copy of the policy taken before training."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    gamma: float = 0.5
    ref_model: torch.nn.Module | None = None


class _EpochBatchSampler(BatchSampler):
    """A BatchSampler whose set_epoch reaches the SP sampler.

    On a mid-epoch resume the Trainer swaps our loader for accelerate's `skip_first_batches` copy,
    a plain DataLoader without set_epoch; it then reaches `loader.batch_sampler.batch_sampler
    .set_epoch` (this object, under accelerate's SkipBatchSampler). Without it the resumed epoch
    would replay epoch 0's shuffle.
    """

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class _EpochDataLoader(DataLoader):
    """A plain DataLoader whose set_epoch reaches the SP sampler (the Trainer calls it per epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class SequenceParallelTrainer(SequenceParallelEvaluation, Trainer):
    """`transformers.Trainer` with exact sequence parallelism (see the module docstring).

    Extra keyword arguments: sequence_parallel_size (default: world size), ulysses_degree,
    ring_degree, layout, mesh (a prebuilt SequenceParallelMesh instead), packing and max_length (for
    the SP collator), fused_loss (default True: chunked lm_head + loss, no [S_local, vocab] logits;
    False: full logits), loss_chunk_tokens (None: one chunk's fp32 logits <= 256 MB) and tiled_mlp
    (False | True = automatic tile count | int tiles), tiled_layer (the same values: norms, projections, RoPE,
    residual adds and MLP of every decoder layer over sequence tiles), attention_kernel ('auto' or a kernel name:
    docs/gpu.md), attention_head_chunks (the attention kernels per group of heads: docs/memory.md), keep_attention
    (with gradient_checkpointing=True: the recompute reuses the attention kernels' outputs: docs/memory.md).
    data_collator: None (the SP collator is built) or a seqpar SP collator.
    """

    _stage = "sft"
    _sp_row_formats: tuple[tuple[str, ...], ...] = (("input_ids",),)  # what the rows must hold (checked at init)
    _sp_row_hint = ("this drop-in trains on tokenized rows (input_ids, optional labels with -100 = unsupervised): "
                    "tokenize them first (e.g. ds.map(lambda r: tok(r['text']), remove_columns=ds.column_names)), "
                    "or use seqpar.trl.SequenceParallelSFTTrainer, which tokenizes text, messages and "
                    "prompt/completion rows")

    def __init__(self, model: torch.nn.Module | None = None, args: Any = None, *,
                 sequence_parallel_size: int | None = None, ulysses_degree: int | None = None,
                 ring_degree: int | None = None, layout: str = "zigzag", mesh: SequenceParallelMesh | None = None,
                 packing: bool = False, max_length: int | None = None, fused_loss: bool = True,
                 loss_chunk_tokens: int | None = None, tiled_mlp: bool | int = False,
                 tiled_layer: bool | int = False, attention_kernel: str = "auto", attention_head_chunks: int = 1,
                 keep_attention: bool = False, **kwargs: Any) -> None:
        from transformers import TrainingArguments

        if model is None:
            raise SeqParError("SequenceParallelTrainer needs model= (an HF causal LM)")
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        name = type(self).__name__
        # the Trainer enables checkpointing itself (train()); the reference stays untiled (PrepareSpec)
        self.sp_prepare = PrepareSpec(fused_loss=bool(fused_loss), loss_chunk_tokens=loss_chunk_tokens,
                                      tiled_mlp=tiled_mlp, tiled_layer=tiled_layer, tile_reference=False,
                                      attention_kernel=check_kernel_name(attention_kernel),
                                      attention_head_chunks=attention_head_chunks, keep_attention=keep_attention)
        check_sp_sizes(name, sequence_parallel_size, ulysses_degree, ring_degree, mesh)
        if self._sp_row_formats:  # the TRL drop-ins check their raw rows before TRL prepares them
            check_dataset_rows(name, {k: kwargs.get(k) for k in ("train_dataset", "eval_dataset")},
                               list(self._sp_row_formats), self._sp_row_hint)
        sequence_parallel_size = map_parallelism_config(name, args, sequence_parallel_size)
        check_stack_args(name, args)
        use_cpu_when_no_accelerator(args)
        say_bf16_on_cpu(args)
        check_memory_args(model, args, self.sp_prepare)  # before args.device creates the process group
        refuse_unsupported(name, args, kwargs)
        _ = args.device  # sets up torch.distributed under torchrun (accelerate), before the mesh
        if mesh is None:
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            # ddp_timeout reaches seqpar's groups too (accelerate gives it to the default group only).
            sp = sequence_parallel_size if sequence_parallel_size is not None else world
            mesh = init_mesh(sp, ulysses_degree, ring_degree,
                             model_config=model.config, layout=layout, timeout=args.ddp_timeout_delta)
        self.sp_mesh = mesh
        self._sp_spec = self._make_spec()
        self._sp_reference = self._build_reference(model, kwargs)
        prepare_model(model, mesh, self.sp_prepare)  # the Trainer's stack wraps it in train() (step 5)
        collator = kwargs.pop("data_collator", None)
        if collator is None:
            collator = self._default_collator(model, kwargs.get("processing_class"), packing, max_length)
        super().__init__(model=model, args=args, data_collator=collator, **kwargs)
        self._place_reference()
        if getattr(args, "gradient_checkpointing", False):
            drop_input_grads_after_enable(self.model, keep_attention=self.sp_prepare.keep_attention)
        # We normalise by the step's global count ourselves: the Trainer must not divide by grad-accum steps.
        self.loss_is_scaled_for_ga = True
        self._sp_metrics: dict[str, float] = {}
        self._sp_metric_n = 0
        self._sp_truncated = 0  # tokens the SP collator cut at max_length since the last log (nothing lost silently)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        fsdp_on_cpu(self)  # accelerate keeps DDP on CPU even when FSDP is asked for

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not load_stateless_fsdp_optimizer(self, checkpoint):  # torch's FSDP2 loading fails on plain SGD
            super()._load_optimizer_and_scheduler(checkpoint)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train; a checkpoint of another layout is checked first (seqpar.hf.trainer_resume)."""
        ckpt = resolve_checkpoint(self, resume_from_checkpoint)
        if ckpt is not None:
            for line in check_resume(self, ckpt):
                if self.args.process_index == 0:
                    print(f"[seqpar] {line}", flush=True)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # where the Trainer just saved
        write_layout(self, os.path.join(self._get_output_dir(trial), folder))

    # ------------------------------------------------------------------ hooks for the DPO subclass
    def _make_spec(self) -> StepSpec:
        return StepSpec("sft", **self.sp_prepare.head_kwargs())

    def _build_reference(self, model: torch.nn.Module, kwargs: dict) -> Any:
        return None

    def _place_reference(self) -> None:
        """Once the Trainer set up its stack: put the frozen reference model where the policy will run."""

    def _default_collator(self, model: torch.nn.Module, tok: Any, packing: bool, max_length: int | None) -> Any:
        kind = VisionCollator if is_vlm_model(model) else SequenceParallelCollator
        return kind(self.sp_mesh, pad_id(model, tok), packing=packing, max_length=max_length)

    # ------------------------------------------------------------------ data
    def _sp_loader(self, dataset: Any, batch_size: int, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise SeqParError("no dataset given: pass train_dataset= / eval_dataset=")
        sampler = SequenceParallelSampler(len(dataset), self.sp_mesh.dp_size, self.sp_mesh.dp_rank,
                                          shuffle=shuffle, seed=self.args.seed)
        batches = _EpochBatchSampler(sampler, batch_size, drop_last=self.args.dataloader_drop_last)
        return _EpochDataLoader(dataset, batch_sampler=batches, collate_fn=self.data_collator,
                                num_workers=self.args.dataloader_num_workers)

    def get_train_dataloader(self) -> DataLoader:
        shuffle = self.args.train_sampling_strategy != "sequential"
        return self._sp_loader(self._supervised_only(self.train_dataset), self._train_batch_size, shuffle)

    def _supervised_only(self, dataset: Any) -> Any:
        """SFT rows with no supervised target within max_length are dropped and counted, as `seqpar train`
        does: a micro-batch of them would be a step of loss 0 / 0, not a training step."""
        if self._sp_spec.stage != "sft" or dataset is None:
            return dataset
        max_length = getattr(self.data_collator, "max_length", None)
        keep = [i for i in range(len(dataset)) if has_target(dataset[i], max_length)]
        dropped = len(dataset) - len(keep)
        if not keep:
            raise SeqParError("no training row has a supervised token (labels != -100 after the first position, "
                              "within max_length): check the labels or raise max_length")
        if dropped and self.args.process_index == 0:
            print(f"[seqpar] dropped {dropped} rows with no supervised token (within max_length)", flush=True)
        return dataset if not dropped else torch.utils.data.Subset(dataset, keep)

    # ------------------------------------------------------------------ loss
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        if not batch_samples:
            return None
        return L.global_token_count(count_items(batch_samples, self._sp_spec.stage), self.sp_mesh).to(device)

    def _grad_factor(self, model: torch.nn.Module) -> float:
        if self.sp_mesh.world_size == 1 or not model.training:
            return 1.0
        return wrapper_factor(type(self).__name__, model, self.sp_mesh, self.accelerator)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        if num_items_in_batch is None:  # outside the training loop: this micro-batch alone
            num_items_in_batch = L.global_token_count(count_items([inputs], self._sp_spec.stage), self.sp_mesh)
        agree_gathers(model, inputs, self.sp_mesh)  # ZeRO-3: the same parameter gathers on every rank
        share, metrics = micro_batch_loss(model, inputs, num_items_in_batch, self.sp_mesh, self._sp_spec,
                                          self._sp_reference)
        if model.training:
            self._sp_record_metrics(metrics, inputs)
        loss = share * self._grad_factor(model)
        return (loss, None) if return_outputs else loss

    def _sp_record_metrics(self, metrics: dict[str, Any], inputs: dict[str, Any]) -> None:
        """A training micro-batch's metrics (micro_batch_loss's per-dp-rank means; the dicts of sums that
        StepSpec.metric_sums adds are the TRL drop-ins' business) and truncation count, for the next log row."""
        metrics = {k: v for k, v in metrics.items() if not isinstance(v, dict)}
        for k, v in metrics.items():
            self._sp_metrics[k] = self._sp_metrics.get(k, 0.0) + float(v)
        self._sp_metric_n += bool(metrics)
        self._sp_truncated += int(inputs.get("num_truncated_tokens", 0))  # the full batch's, same on SP ranks

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # a training log row, on every rank: tokens max_length cut since the last one
            n = comm.all_reduce_values([float(self._sp_truncated)], self.sp_mesh.dp_group, self.sp_mesh.comm_device)
            logs["num_truncated_tokens"] = int(n[0])
            self._sp_truncated = 0
        if self._sp_metric_n and "loss" in logs:
            vals = [v / self._sp_metric_n for v in self._sp_metrics.values()]
            # SP ranks of a group hold identical metrics; sent from the mesh's comm device (NCCL: CUDA).
            vals = comm.all_reduce_values(vals, self.sp_mesh.dp_group, self.sp_mesh.comm_device)
            logs.update({k: v / self.sp_mesh.dp_size for k, v in zip(self._sp_metrics, vals.tolist())})
            self._sp_metrics, self._sp_metric_n = {}, 0
        super().log(logs, *args, **kwargs)

class SequenceParallelDPOTrainer(SequenceParallelTrainer):
    """DPO / IPO / SimPO under SP, as a Trainer drop-in.

    ref_model: a frozen reference; default: the policy with its LoRA adapter disabled (PEFT models),
    or a frozen copy of the policy taken before training. SimPO needs none.
    """

    _stage = "dpo"
    _sp_row_formats = (("prompt_input_ids", "chosen_input_ids", "rejected_input_ids"),)
    _sp_row_hint = ("this drop-in trains on tokenized preference pairs: tokenize prompt, chosen and rejected into "
                    "those columns first, or use seqpar.trl.SequenceParallelDPOTrainer, which takes prompt / chosen / "
                    "rejected text")

    def __init__(self, model: torch.nn.Module | None = None, ref_model: torch.nn.Module | None = None,
                 args: Any = None, *, beta: float = 0.1, loss_type: str = "sigmoid", gamma: float = 0.5,
                 **kwargs: Any) -> None:
        if loss_type not in L.DPO_LOSS_TYPES:
            raise SeqParError(f"loss_type={loss_type!r} is unknown: use one of {L.DPO_LOSS_TYPES}")
        self._dpo = DPOSettings(beta, loss_type, gamma, ref_model)
        if kwargs.get("packing"):
            raise SeqParError("packing is not supported for DPO pairs: drop packing=True")
        super().__init__(model, args, **kwargs)

    def _make_spec(self) -> StepSpec:
        d, p = self._dpo, self.sp_prepare
        return StepSpec("dpo", d.beta, d.loss_type, d.gamma, p.fused_loss, p.loss_chunk_tokens)

    def _build_reference(self, model: torch.nn.Module, kwargs: dict) -> Any:
        ref = self._dpo.ref_model
        if self._dpo.loss_type == "simpo":
            return None
        if ref is None and hasattr(model, "disable_adapter"):
            return ReferenceLogps(self.sp_mesh, policy=model, **self.sp_prepare.head_kwargs())
        if ref is None and is_zero3(model):
            raise SeqParError("the policy is partitioned by DeepSpeed ZeRO-3 (loaded after the TrainingArguments), so "
                              "it cannot be copied as the reference: pass ref_model= loaded the same way, or train a "
                              "PEFT adapter (the reference is then the policy with the adapter disabled)")
        if ref is None:
            ref = policy_copy(model, type(self).__name__)
        ref = frozen_reference(ref, self.sp_mesh, self.sp_prepare)
        # placed on the Trainer's stack by _place_reference, once it exists
        return ReferenceLogps(self.sp_mesh, ref_model=ref, **self.sp_prepare.head_kwargs())

    def _place_reference(self) -> None:
        ref = self._sp_reference
        if ref is None or ref.ref_model is None:
            return
        prepared = getattr(self, "ref_model", None)  # trl.DPOTrainer prepared the ref_model it was given
        ref.ref_model = prepared if prepared is not None else prepare_reference(self, ref.ref_model)

    def _default_collator(self, model: torch.nn.Module, tok: Any, packing: bool, max_length: int | None) -> Any:
        vlm = is_vlm_model(model)  # pairs with prompt images / videos
        return (VisionDPOCollator if vlm else SequenceParallelDPOCollator)(self.sp_mesh, pad_id(model, tok),
                                                                           max_length=max_length)

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        return dataset  # the pair columns are not model.forward arguments, but the collator needs them


