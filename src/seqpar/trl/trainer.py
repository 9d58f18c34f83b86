"""`trl.SFTTrainer` / `trl.DPOTrainer` drop-ins that train under exact sequence parallelism.

    trainer = SequenceParallelSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                                         processing_class=tok, sequence_parallel_size=2)  # was: SFTTrainer(...)

Division of labour: TRL prepares the dataset as usual (tokenisation, chat templates, prompt/completion
and messages formats, completion_only_loss / assistant_only_loss labels, max_length truncation,
packing with seq_lengths, DPO prompt/chosen/rejected ids). From the tokenised rows on, each class is
seqpar's HF Trainer drop-in (seqpar.hf.trainer: the same mesh set-up, SP sampler, collators,
global-token loss normalisation, gradient factor, SP evaluate, memory features): the classes inherit
from BOTH, seqpar's first, so seqpar's compute_loss / dataloaders / evaluate win and TRL's __init__
(dataset preparation, reference model bookkeeping) and log run underneath.

Logged metrics: TRL's own, with stock TRL's definitions and averaging (see _TRLMetrics): SFT "entropy",
"mean_token_accuracy", "num_tokens"; DPO also "logits/chosen|rejected", "rewards/chosen|rejected|accuracies|
margins", "logps/chosen|rejected". Each rank sums its shard's share of a micro-batch; the sums are reduced over
sp and dp at the log row, so each value is what stock TRL logs on one process for the same rows.

TRL options that would silently do something else under SP are refused at construction with a
SeqParError naming the alternative (identically on every rank, before any collective):
- both: use_liger_kernel, activation_offloading, compute_loss_func, a custom data_collator;
- SFT: loss_type="dft", label_smoothing_factor > 0. padding_free=True (flash-attn in TRL) is mapped
  to seqpar's packing path (documents separated by position_ids / cu_seqlens), as is packing. Image datasets
  (Qwen VL): TRL's vision collator builds each batch, seqpar shards it (sft_vision.py; videos and packing refused);
- DPO: loss_type other than one of "sigmoid" / "ipo" (with weight 1), f_divergence_type other than
  "reverse_kl", ld_alpha, use_weighting, sync_ref_model, precompute_ref_log_probs (TRL's precompute
  runs the un-sharded model), truncation_mode="keep_end", video columns (stock TRL's DPO has no video path).
DPO with images (a processor as processing_class, an "images" / "image" column): TRL's
DataCollatorForVisionPreference renders each micro-batch as stock; seqpar trains the pairs with their prompt
images under SP (seqpar.trl.collators.TRLVisionDPOCollator, each image encoded once per SP group).
"""

from __future__ import annotations

from typing import Any

import torch
import trl

from .. import comm
from .. import loss as L
from ..errors import SeqParError
from ..hf.prepare import policy_copy
from ..hf.trainer import DPOSettings, SequenceParallelTrainer
from ..hf.trainer import SequenceParallelDPOTrainer as HFDPOTrainer
from ..hf.trainer_stack import is_zero3
from ..hf.vision import is_vlm_model
from ..mesh import SequenceParallelMesh
from ..steps import StepSpec, micro_batch_loss, sft_metric_sums
from .args import (
    check_trl_rows,
    coerce_args,
    instantiate,
    refuse,
    refuse_common,
    refuse_moe_aux,
    refuse_video_columns,
    sp_kwargs,
)
from .collators import TRLDPOCollator, TRLSFTCollator, TRLVisionDPOCollator
from .sft_vision import TRLVisionSFTCollator, TRLVLMTextCollator, check_sft_vision

__all__ = ["SequenceParallelSFTTrainer", "SequenceParallelDPOTrainer"]

TRL_DPO_LOSS_TYPES = ("sigmoid", "ipo")  # TRL's definitions that seqpar.loss.dpo_loss computes identically


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0  # TRL logs 0.0 for a micro-batch without a counted token


class _TRLMetrics:
    """TRL's logged metrics under SP, equal to what stock TRL logs on one process for the same rows.

    Stock TRL (1.16), per micro-batch: each metric is a ratio of sums gathered over all processes (entropy:
    sum of per-token entropies / supervised-token count; mean_token_accuracy: argmax hits / that count, over
    the shifted supervised targets; DPO rewards/logps: the mean over the micro-batch's pairs), appended to a
    list; the log row averages the list (a mean over micro-batches, not over tokens); "num_tokens" is the
    running total of input tokens (the attention_mask sum, gathered over processes) since training started.

    Here micro_batch_loss (StepSpec.metric_sums) returns each micro-batch's sums over this rank's positions
    ("shard_sums") and over its rows ("batch_sums", identical on the SP ranks of a group: only SP rank 0 adds
    them, so a row counts once). They are kept as tensors and reduced at the next log row: one sum over sp and
    one over dp for all micro-batches since the previous row (every rank runs the same micro-batches, so every
    rank issues the same two collectives), then turned into TRL's per-micro-batch ratios and handed to TRL's
    own log() through its `_metrics`, which averages them as stock. evaluate() does the same for the "eval"
    metrics of each eval step (a dp rank's discarded padding batch adds zeros); with compute_metrics= (SFT)
    the eval forward produces full logits for the predictions instead, and the same sums come from them.
    """

    def _init_trl_metrics(self) -> None:
        self._sp_trl_sums: dict[str, list] = {"train": [], "eval": []}
        self._sp_evaluating = False

    def _make_spec(self) -> StepSpec:
        spec = super()._make_spec()
        spec.metric_sums = True
        return spec

    def _trl_values(self, s: dict[str, float]) -> dict[str, float]:
        """TRL's metrics of one micro-batch from its global sums, in TRL's key order ("num_tokens" only marks
        its place: the running total is logged)."""
        raise NotImplementedError

    def _sp_sum_vector(self, metrics: dict[str, Any]) -> tuple[tuple[str, ...], torch.Tensor]:
        shard, rows = metrics["shard_sums"], metrics["batch_sums"]
        own = self.sp_mesh.sp_rank == 0
        vals = [*shard.values(), *(v if own else torch.zeros_like(v) for v in rows.values())]
        return (*shard, *rows), torch.stack(vals)

    def _sp_record_metrics(self, metrics: dict[str, Any], inputs: dict[str, Any]) -> None:
        self._sp_trl_sums["train"].append(self._sp_sum_vector(metrics))
        # TRL's own rewards / logps definitions replace the HF DPO drop-in's; its pair-mean "loss" stays.
        super()._sp_record_metrics({k: v for k, v in metrics.items() if k == "loss"}, inputs)

    def _sp_flush_trl_metrics(self, mode: str) -> None:
        """The pending micro-batches' sums -> TRL's `_metrics[mode]` (two collectives, on every rank alike)."""
        pending, self._sp_trl_sums[mode] = self._sp_trl_sums[mode], []
        if not pending:  # the same on every rank: one entry per training micro-batch / eval step
            return
        keys, dev = pending[0][0], self.sp_mesh.comm_device
        sums = torch.stack([v for _, v in pending]).to(dev)
        comm.all_reduce_(sums, self.sp_mesh.sp_group, device=dev)
        comm.all_reduce_(sums, self.sp_mesh.dp_group, device=dev)
        for row in sums.cpu().tolist():
            s = dict(zip(keys, row))
            if mode == "train":
                self._total_train_tokens += int(round(s["input_tokens"]))
            for k, v in self._trl_values(s).items():
                if k == "num_tokens":
                    self._metrics[mode][k] = [self._total_train_tokens]
                else:
                    self._metrics[mode][k].append(v)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if not self._sp_evaluating:
            # The Trainer's training rows and its end-of-training row (which, as stock, carries the metrics of
            # micro-batches after the last logged step): every rank logs them after the same micro-batches.
            if "loss" in logs or "train_loss" in logs:
                self._sp_flush_trl_metrics("train")
            return super().log(logs, *args, **kwargs)
        self._sp_flush_trl_metrics("eval")
        # TRL's log() takes the "eval" metrics when the model is in eval mode, as the stock Trainer's eval loop
        # leaves it; seqpar's evaluate() has restored training mode by now (without this, the eval row would
        # take, and clear, the pending training metrics).
        was = self.model.training
        self.model.training = False
        try:
            return super().log(logs, *args, **kwargs)
        finally:
            self.model.training = was

    def evaluate(self, *args: Any, **kwargs: Any) -> dict:
        self._sp_trl_sums["eval"], self._sp_evaluating = [], True
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._sp_evaluating = False

    def _sp_keep_eval_sums(self, metrics: dict[str, Any], padding: bool) -> None:
        """One eval step's metric sums (evaluate() only: predict() logs no row); a padding batch, which only
        keeps the collectives matched, counts nothing."""
        if self._sp_evaluating:
            keys, vec = self._sp_sum_vector(metrics)
            self._sp_trl_sums["eval"].append((keys, torch.zeros_like(vec) if padding else vec))

    def _sp_eval_logits(self, logits: torch.Tensor, labels: torch.Tensor, batch: dict, padding: bool) -> None:
        """compute_metrics= (SFT): TRL's eval metrics from the full-logits forward, as stock TRL computes them."""
        if self._sp_evaluating:
            tok = L.token_metric_stats(logits, labels, chunk_tokens=self._sp_spec.loss_chunk_tokens)
            self._sp_keep_eval_sums(sft_metric_sums(tok, labels, batch), padding)

    def _sp_eval_forward(self, model: torch.nn.Module, batch: dict, rows: list | None,
                         want_preds: bool) -> tuple[torch.Tensor, list]:
        if want_preds:  # compute_metrics: the full-logits forward of seqpar.hf.trainer_eval (_sp_eval_logits)
            return super()._sp_eval_forward(model, batch, rows, want_preds)
        share, metrics = micro_batch_loss(model, batch, 1, self.sp_mesh, self._sp_spec, self._sp_reference)
        self._sp_keep_eval_sums(metrics, padding=rows is not None)  # rows == []: a padding batch
        return share, []


class SequenceParallelSFTTrainer(_TRLMetrics, SequenceParallelTrainer, trl.SFTTrainer):
    """`trl.SFTTrainer` with exact sequence parallelism (see the module docstring).

    Extra keyword arguments as seqpar.hf.SequenceParallelTrainer: sequence_parallel_size (default:
    world size), ulysses_degree, ring_degree, layout, mesh, fused_loss, loss_chunk_tokens, tiled_mlp,
    tiled_layer, attention_kernel (passed through to it).
    Packing, max_length and the masks come from the SFTConfig.
    """

    _sp_row_formats = ()  # TRL reads the raw rows: check_trl_rows checks them before TRL prepares them

    def __init__(self, model: Any, args: Any = None, data_collator: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *, sequence_parallel_size: int | None = None,
                 ulysses_degree: int | None = None, ring_degree: int | None = None, layout: str = "zigzag",
                 mesh: SequenceParallelMesh | None = None, fused_loss: bool = True,
                 loss_chunk_tokens: int | None = None, tiled_mlp: bool | int = False, peft_config: Any = None,
                 **kwargs: Any) -> None:
        name = type(self).__name__
        args = coerce_args(args, trl.SFTConfig, model, "SFT")
        refuse_common(name, args, data_collator, kwargs)
        check_sft_vision(name, args, train_dataset, eval_dataset)  # images: TRL's vision collator (sft_vision.py)
        check_trl_rows(name, "SFT", args, train_dataset, eval_dataset, kwargs)
        if args.loss_type != "nll":
            raise refuse(name, f"loss_type={args.loss_type!r}", "seqpar computes the token-mean NLL only",
                          "use loss_type='nll'")
        if args.label_smoothing_factor > 0:
            raise refuse(name, "label_smoothing_factor > 0", "seqpar computes the plain NLL",
                          "set label_smoothing_factor=0.0")
        model = instantiate(model, args, peft_config)
        SequenceParallelTrainer.__init__(
            self, model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class,
            **sp_kwargs(sequence_parallel_size, ulysses_degree, ring_degree, layout, mesh, fused_loss,
                         loss_chunk_tokens, tiled_mlp), **kwargs)
        refuse_moe_aux(self)
        # TRL's padding_free (flash-attn varlen) and packing both mean "several documents in one row":
        # seqpar's packing path separates them by position_ids / cu_seqlens in its own attention.
        packing = bool(args.packing or args.padding_free)
        pad = self._tokenizer.pad_token_id
        if self._is_vision_dataset:  # TRL's vision collator builds each full micro-batch, seqpar shards it
            self.data_collator = TRLVisionSFTCollator(self.data_collator, self.sp_mesh, pad)
        elif is_vlm_model(self.model):  # text rows on a VL model
            self.data_collator = TRLVLMTextCollator(self.sp_mesh, pad, packing=packing)
        else:
            self.data_collator = TRLSFTCollator(self.sp_mesh, pad, packing=packing)
        self._init_trl_metrics()

    def _supervised_only(self, dataset: Any) -> Any:
        # Image rows get their labels from TRL's collator per micro-batch: every row is kept, as stock TRL keeps it.
        return dataset if self._is_vision_dataset else super()._supervised_only(dataset)

    def _trl_values(self, s: dict[str, float]) -> dict[str, float]:
        return {"entropy": _ratio(s["entropy"], s["tokens"]), "mean_token_accuracy": _ratio(s["top1"], s["tokens"]),
                "num_tokens": 0.0}

    def _default_collator(self, model: torch.nn.Module, tok: Any, packing: bool, max_length: int | None) -> Any:
        return None  # TRL builds its own during __init__; ours (over TRL's rows) replaces it right after


class SequenceParallelDPOTrainer(_TRLMetrics, HFDPOTrainer, trl.DPOTrainer):
    """`trl.DPOTrainer` with exact sequence parallelism (loss_type "sigmoid" or "ipo").

    ref_model: as TRL (default for a PEFT policy: the adapter disabled; otherwise a frozen copy of the
    policy taken before training, where TRL would reload it from the hub by name). Extra keyword
    arguments as SequenceParallelSFTTrainer.
    """

    _sp_row_formats = ()  # TRL reads the raw rows: check_trl_rows checks them before TRL prepares them

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None, *,
                 sequence_parallel_size: int | None = None, ulysses_degree: int | None = None,
                 ring_degree: int | None = None, layout: str = "zigzag", mesh: SequenceParallelMesh | None = None,
                 fused_loss: bool = True, loss_chunk_tokens: int | None = None, tiled_mlp: bool | int = False,
                 peft_config: Any = None, **kwargs: Any) -> None:
        name = type(self).__name__
        args = coerce_args(args, trl.DPOConfig, model, "DPO")
        refuse_common(name, args, data_collator, kwargs)
        refuse_video_columns(name, "stock trl.DPOTrainer's vision path takes images only", "train preference pairs "
                             "with videos with `seqpar train` (stage: dpo, docs/hf.md)", train_dataset, eval_dataset)
        check_trl_rows(name, "DPO", args, train_dataset, eval_dataset, kwargs)
        loss_type = _dpo_loss_type(name, args)
        model = instantiate(model, args, peft_config)
        if isinstance(ref_model, str):
            ref_model = instantiate(ref_model, args, None)
        if ref_model is None and not hasattr(model, "disable_adapter") and is_zero3(model):
            ref_model = _reload_reference(name, model, args)  # a ZeRO-3-partitioned policy cannot be copied
        if ref_model is None and not hasattr(model, "disable_adapter"):
            ref_model = policy_copy(model, name)
        self._dpo = DPOSettings(args.beta, loss_type, 0.5, ref_model)
        SequenceParallelTrainer.__init__(
            self, model, args, ref_model=ref_model, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class,
            **sp_kwargs(sequence_parallel_size, ulysses_degree, ring_degree, layout, mesh, fused_loss,
                         loss_chunk_tokens, tiled_mlp), **kwargs)
        refuse_moe_aux(self)
        pad = getattr(self.processing_class, "pad_token_id", None)  # a processor: its tokenizer's, below
        if pad is None:
            pad = getattr(getattr(self.processing_class, "tokenizer", None), "pad_token_id", None)
        if getattr(self, "_is_vision_dataset", False):  # TRL's vision collator renders each micro-batch
            self.data_collator = TRLVisionDPOCollator(self.sp_mesh, pad, self.data_collator, max_length=args.max_length)
        else:
            self.data_collator = TRLDPOCollator(self.sp_mesh, pad, max_length=args.max_length)
        self._init_trl_metrics()

    def _trl_values(self, s: dict[str, float]) -> dict[str, float]:
        pairs = s["pairs"]
        return {
            "entropy": _ratio(s["entropy"], s["tokens"]), "num_tokens": 0.0,
            "logits/chosen": _ratio(s["chosen_logits"], s["chosen_tokens"]),
            "logits/rejected": _ratio(s["rejected_logits"], s["rejected_tokens"]),
            "mean_token_accuracy": _ratio(s["chosen_top1"], s["chosen_tokens"]),
            "rewards/chosen": _ratio(s["rewards_chosen"], pairs),
            "rewards/rejected": _ratio(s["rewards_rejected"], pairs),
            "rewards/accuracies": _ratio(s["rewards_accuracies"], pairs),
            "rewards/margins": _ratio(s["rewards_margins"], pairs),
            "logps/chosen": _ratio(s["logps_chosen"], pairs), "logps/rejected": _ratio(s["logps_rejected"], pairs),
        }

    def _default_collator(self, model: torch.nn.Module, tok: Any, packing: bool, max_length: int | None) -> Any:
        return None  # TRL builds its own during __init__; ours (over TRL's rows) replaces it right after


def _reload_reference(name: str, model: torch.nn.Module, args: Any) -> torch.nn.Module:
    """The reference loaded again by name, as stock TRL does (under ZeRO-3 it is partitioned at load too)."""
    path = getattr(model.config, "_name_or_path", "")
    if not path:
        raise SeqParError(f"{name}: the policy is partitioned by DeepSpeed ZeRO-3 and has no name or path to load "
                          "the reference from: pass ref_model= (loaded after the DPOConfig, like the policy), or "
                          "train a PEFT adapter (the reference is then the policy with the adapter disabled)")
    return instantiate(path, args, None)


def _dpo_loss_type(name: str, args: Any) -> str:
    """The one TRL loss_type seqpar computes exactly, or a SeqParError naming what to change."""
    types = list(args.loss_type) if isinstance(args.loss_type, (list, tuple)) else [args.loss_type]
    weights = list(args.loss_weights) if args.loss_weights is not None else [1.0] * len(types)
    if len(types) != 1 or types[0] not in TRL_DPO_LOSS_TYPES or weights != [1.0]:
        raise refuse(name, f"loss_type={args.loss_type!r} (loss_weights={args.loss_weights!r})",
                      f"seqpar computes TRL's {' / '.join(TRL_DPO_LOSS_TYPES)} losses only, one at a time, weight 1",
                      "use loss_type=['sigmoid'] or ['ipo'] (SimPO: seqpar.hf.SequenceParallelDPOTrainer "
                      "loss_type='simpo')")
    checks = [
        (args.f_divergence_type != "reverse_kl", f"f_divergence_type={args.f_divergence_type!r}",
         "use f_divergence_type='reverse_kl'"),
        (args.ld_alpha is not None, "ld_alpha=", "drop ld_alpha"),
        (args.use_weighting, "use_weighting=True", "set use_weighting=False"),
        (args.sync_ref_model, "sync_ref_model=True", "set sync_ref_model=False"),
        (args.precompute_ref_log_probs, "precompute_ref_log_probs=True",
         "drop it (the reference forward then runs under SP), or add ref_chosen_logps / ref_rejected_logps "
         "columns to the dataset yourself: seqpar uses them from the rows"),
        (args.truncation_mode != "keep_start", f"truncation_mode={args.truncation_mode!r}",
         "use truncation_mode='keep_start' or raise max_length"),
    ]
    for bad, what, instead in checks:
        if bad:
            raise refuse(name, what, "seqpar's DPO step does not implement it", instead)
    return types[0]
