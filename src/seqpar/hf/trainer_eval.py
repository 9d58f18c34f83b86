"""Evaluation of the Trainer drop-ins under SP (mixed into seqpar.hf.trainer.SequenceParallelTrainer).

evaluate() reports seqpar's exact eval_loss: the global token mean over every eval row, each counted once
(the stock Trainer's with compute_metrics is a mean of per-batch means). With compute_metrics= (SFT), evaluate()
and predict() hand it an EvalPrediction laid out as the stock `transformers.Trainer` on ONE process does:

- label_ids [rows, S_max]: each row's UNshifted labels as the SP collator prepared them (-100 = unsupervised; a row
  without "labels" is supervised on every token, so its labels are its input_ids), after max_length truncation;
- predictions [rows, S_max, vocab]: the logits in sequence order, or what preprocess_logits_for_metrics returns
  ([rows, S_max, ...]; a tuple of such stays a tuple);
- rows in dataset order whatever dp is; S_max is the longest row; positions past a row's end hold -100 (the stock
  Trainer's padding index across batches); eval_do_concat_batches=False: one array per eval step;
- include_for_metrics=["inputs"]: EvalPrediction.inputs = the rows' input ids, -100 past each row's end.
The metric keys come back prefixed (eval_accuracy); eval_loss / eval_items / eval_perplexity are seqpar's own.

How: each eval batch runs ONE forward with real logits (the fused loss head is bypassed, so this rank holds its
shard's [B, S/sp, vocab] logits for that batch, as with fused_loss=False); eval_loss comes from those logits.
preprocess_logits_for_metrics runs on each rank's shard, and only its output is gathered in sequence order
(seqpar.layout.unshard), then over dp. Without preprocess_logits_for_metrics the FULL logits [rows, S, vocab]
are gathered onto every rank and kept (on CPU) for the whole eval set, as the stock Trainer keeps them on every
process: at long context reduce them per token first (e.g. `lambda logits, labels: logits.argmax(-1)`).

Differences from the stock Trainer, all about what is not one row's own tokens:
- positions past a row's end hold -100 in predictions: the stock Trainer holds there its outputs on the pad tokens
  of that row's batch (they depend on the collator's padding and attention mask). Mask with label_ids != -100 as
  usual; the arrays equal the stock Trainer's with per_device_eval_batch_size=1;
- preprocess_logits_for_metrics(logits, labels) sees one SP shard: logits [B, S_local, vocab] and the unshifted
  labels [B, S_local] of this rank's positions, in the shard's (zigzag) order. It must work position by position
  (argmax, a log-softmax gather, top-k) and return [B, S_local, ...] tensors; anything that mixes positions
  belongs in compute_metrics;
- a packing collator is used with packing off for these batches (one row per sequence, as the metric needs):
  max_length then cuts each row instead of the packed sequence;
- include_for_metrics=["loss"] is refused (it passes per-batch mean losses, which depend on the batching).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import time
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers.trainer_pt_utils import EvalLoopContainer
from transformers.trainer_utils import EvalPrediction, PredictionOutput, denumpify_detensorize, speed_metrics

from .. import comm
from .. import loss as L
from ..data import SequenceParallelCollator
from ..errors import SeqParError
from ..layout import shard, unshard
from ..steps import count_items, forward_logits, micro_batch_loss
from .trainer_stack import agree_gathers

PAD_INDEX = -100  # the stock Trainer's padding index for predictions / labels / inputs


def _metric_collate(collator: SequenceParallelCollator, rows: list) -> tuple[dict, list]:
    """(this rank's SP batch, [(input_ids, unshifted labels)] per row as the collator prepared them).

    One row per sequence: a packing collator is copied with packing off. The rows are recorded where the
    collator assembles them, so subclasses that rename columns first (seqpar.trl) are covered too."""
    c = copy.copy(collator)
    c.packing = False
    prepared: list = []
    assemble = c._assemble

    def record(rs: list) -> dict:
        prepared.extend(rs)
        return assemble(rs)

    c._assemble = record
    try:
        batch = c(rows)
    except SeqParError as e:
        if not collator.packing:
            raise
        raise SeqParError(
            f"{e} -- compute_metrics / predict() score one row per sequence, so the packing collator runs unpacked "
            "for them: evaluate rows that hold one document each (TRL: eval_packing=False in the SFTConfig)"
        ) from None
    return batch, [(r.input_ids, r.labels) for r in prepared]


def _nested(fn: Any, x: Any) -> Any:
    return type(x)(fn(t) for t in x) if isinstance(x, (tuple, list)) else fn(x)


def _take_row(preds: Any, i: int, n: int) -> Any:
    """Row i's first n positions; clone(): a row must not pin (or pickle, over dp) the whole batch's storage."""
    return _nested(lambda t: t[i, :n].clone(), preds)


def _check_per_position(out: Any, shape: tuple[int, int]) -> None:
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise SeqParError(
                f"preprocess_logits_for_metrics returned {got}; under SP it runs on each rank's shard of the "
                f"sequence and must return a tensor (or a tuple of tensors) per position, [batch, positions, ...] "
                f"= {shape}: keep it position by position (argmax, a log-softmax gather) and reduce over positions "
                "in compute_metrics"
            )


def _stack_rows(parts: list) -> Any:
    """[R, longest, ...] from per-row tensors [n_i, ...], PAD_INDEX past each row's end (tuples stay tuples)."""
    if isinstance(parts[0], (tuple, list)):
        return type(parts[0])(_stack_rows([p[k] for p in parts]) for k in range(len(parts[0])))
    out = parts[0].new_full((len(parts), max(p.shape[0] for p in parts), *parts[0].shape[1:]), PAD_INDEX)
    for i, p in enumerate(parts):
        out[i, : p.shape[0]] = p
    return out


class SequenceParallelEvaluation:
    """evaluate() / predict() for SequenceParallelTrainer: every eval row counted exactly once, eval_loss global,
    compute_metrics / preprocess_logits_for_metrics as the stock Trainer (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        spec = getattr(self, "_sp_spec", None)  # set by SequenceParallelTrainer before the Trainer's __init__
        if spec is not None and spec.stage != "sft":
            for key in ("compute_metrics", "preprocess_logits_for_metrics"):
                if kwargs.get(key) is not None:
                    raise SeqParError(
                        f"{type(self).__name__}: {key}= is not supported for {spec.stage.upper()} (its "
                        "eval batches are preference pairs, not rows with labels): drop it; evaluate() reports the "
                        "pair-averaged eval_loss; compute_metrics works with SequenceParallelTrainer (SFT)"
                    )
        super().__init__(*args, **kwargs)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """This dp rank's eval rows (dp_rank, dp_rank + dp, ...) in order, each exactly once (no wrap-around)."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(ds, str):
            ds = self.eval_dataset[ds]
        if ds is None:
            raise SeqParError("no dataset given: pass eval_dataset=")
        mine = list(range(self.sp_mesh.dp_rank, len(ds), self.sp_mesh.dp_size))
        bs = self.args.eval_batch_size
        batches = [mine[i:i + bs] for i in range(0, len(mine), bs)]
        return DataLoader(ds, batch_sampler=batches, collate_fn=self.data_collator,
                          num_workers=self.args.dataloader_num_workers)

    def _eval_padding_batches(self, dataset_len: int, own_batches: int) -> int:
        """How many discarded batches this dp rank runs so every rank runs the longest rank's count."""
        dp, bs = self.sp_mesh.dp_size, self.args.eval_batch_size
        return math.ceil(math.ceil(dataset_len / dp) / bs) - own_batches

    # ------------------------------------------------------------------ eval under SP
    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """Global token-averaged eval loss (pair-averaged for DPO), computed sequence-parallel, plus
        compute_metrics' metrics (SFT) from predictions gathered in sequence order. ignore_keys: accepted for
        the Trainer's signature; only the model output's logits are ever gathered."""
        start = time.time()
        want = self.compute_metrics is not None and not self.args.prediction_loss_only
        _, _, metrics = self._sp_eval_loop(eval_dataset, metric_key_prefix, want, "Evaluation", start)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: Any = None, metric_key_prefix: str = "test") -> Any:
        """PredictionOutput(predictions, label_ids, metrics) as the stock Trainer's (see the module docstring);
        metrics: test_loss (seqpar's global token mean), compute_metrics' metrics, runtime."""
        if self._sp_spec.stage != "sft":
            raise SeqParError(f"{type(self).__name__}.predict() is not supported for {self._sp_spec.stage.upper()} "
                              "(the batches are preference pairs): use evaluate() for the pair-averaged eval_loss")
        start = time.time()
        preds, labels, metrics = self._sp_eval_loop(test_dataset, metric_key_prefix,
                                                    not self.args.prediction_loss_only, "Prediction", start)
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
        return PredictionOutput(predictions=preds, label_ids=labels, metrics=metrics)

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        raise SeqParError(
            f"{type(self).__name__}.prediction_step() is not supported (a batch's logits are sharded over the "
            "sequence, and seqpar's evaluate() / predict() do not call it): use evaluate() with compute_metrics= "
            "(and preprocess_logits_for_metrics=), or predict(), which gather predictions in sequence order"
        )

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def _sp_eval_loop(self, dataset: Any, prefix: str, want_preds: bool, description: str,
                      start: float) -> tuple[Any, Any, dict]:
        """(predictions, label_ids, metrics) over `dataset`; predictions / label_ids None unless want_preds."""
        loader = self.get_eval_dataloader(dataset)
        n_pad = self._eval_padding_batches(len(loader.dataset), len(loader.batch_sampler))
        if want_preds:
            loader = DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                collate_fn=functools.partial(_metric_collate, self._metric_collator()),
                                num_workers=self.args.dataloader_num_workers)
        n_steps = len(loader.batch_sampler) + n_pad
        filler = (loader.collate_fn([loader.dataset[0]]) for _ in range(n_pad))
        model = self.model
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64)
        items = torch.zeros((), dtype=torch.long)
        kept = [EvalLoopContainer(self.args.eval_do_concat_batches, padding_index=PAD_INDEX) for _ in range(3)]
        self._sp_batch_metrics: dict = {}
        try:
            for step, batch in enumerate(itertools.chain(loader, filler)):
                counted = step < len(loader.batch_sampler)  # a padding batch only keeps the collectives matched
                batch, rows = batch if want_preds else (batch, None)
                batch = self._prepare_inputs(batch)
                # Denominator 1 gives this rank's share of the SUM of losses; normalise once at the end.
                agree_gathers(model, batch, self.sp_mesh)  # ZeRO-3: the same parameter gathers on every rank
                share, rows = self._sp_eval_forward(model, batch, rows if counted else [], want_preds)
                if counted:
                    total += share.detach().double().cpu()
                    items += count_items([batch], self._sp_spec.stage).cpu()
                if want_preds:
                    self._sp_keep_step(kept, self._sp_gather_rows(rows), step == n_steps - 1, description)
        finally:
            model.train(was_training)
        total = L.global_loss(total, self.sp_mesh)
        items = int(L.global_token_count(items, self.sp_mesh))
        arrays = [k.get_arrays() for k in kept]
        metrics = self._sp_metrics_dict(arrays, float(total) / max(items, 1), items, prefix)
        steps_total = math.ceil(len(loader.dataset) / (self.args.eval_batch_size * self.sp_mesh.dp_size))
        metrics.update(speed_metrics(prefix, start, num_samples=len(loader.dataset), num_steps=steps_total))
        return arrays[0], arrays[1], metrics

    def _metric_collator(self) -> SequenceParallelCollator:
        c = self.data_collator
        if self._sp_spec.stage != "sft" or not isinstance(c, SequenceParallelCollator):
            raise SeqParError(f"{type(self).__name__}: predictions need an SFT SequenceParallelCollator, got "
                              f"{type(c).__name__} (stage {self._sp_spec.stage})")
        return c

    def _sp_eval_forward(self, model: torch.nn.Module, batch: dict, rows: list | None,
                         want_preds: bool) -> tuple[torch.Tensor, list]:
        """(this rank's loss share of one eval batch, [(prediction, labels, input_ids)] per row: CPU, sequence
        order, each row's own length; [] without want_preds or for a padding batch (rows == []))."""
        if not want_preds:
            share, _ = micro_batch_loss(model, batch, 1, self.sp_mesh, self._sp_spec, self._sp_reference)
            return share, []
        logits = forward_logits(model, batch)  # no fused request pending: the head returns real logits
        shift = batch["shift_labels"].to(logits.device)
        share = L.sft_loss_from_nll(L.token_nll(logits, shift), shift, 1, mesh=self.sp_mesh)
        self._sp_eval_logits(logits, shift, batch, padding=not rows)
        if not rows:  # a padding batch: its whole SP group skips the gather together
            return share, []
        labels = torch.full((len(rows), shift.shape[1] * self.sp_mesh.sp_size), PAD_INDEX, dtype=torch.long)
        for i, (_, lab) in enumerate(rows):
            labels[i, : lab.numel()] = lab
        preds = logits
        if self.preprocess_logits_for_metrics is not None:
            preds = self.preprocess_logits_for_metrics(logits, shard(labels, self.sp_mesh).to(logits.device))
            _check_per_position(preds, tuple(logits.shape[:2]))
        del logits
        dev = self.sp_mesh.comm_device
        preds = _nested(lambda t: unshard(t.to(dev), self.sp_mesh, dim=1).cpu(), preds)
        return share, [(_take_row(preds, i, ids.numel()), lab, ids) for i, (ids, lab) in enumerate(rows)]

    def _sp_eval_logits(self, logits: torch.Tensor, labels: torch.Tensor, batch: dict, padding: bool) -> None:
        """An eval batch's full local logits and shift_labels (compute_metrics= runs): for subclasses that log
        their own eval metrics from them (the TRL drop-ins); padding: a batch that only keeps collectives matched."""

    def _sp_gather_rows(self, rows: list) -> list:
        """The rows of one eval step over all dp ranks, in dataset order: at step k dp rank d holds rows
        dp*bs*k + dp*j + d (j < its batch size), so the union is a contiguous block, ordered by (j, d)."""
        dp = self.sp_mesh.dp_size
        if dp == 1:
            return rows
        parts = comm.all_gather_object(rows, self.sp_mesh.dp_group)
        return [parts[d][j] for j in range(max(len(p) for p in parts)) for d in range(dp) if j < len(parts[d])]

    def _sp_keep_step(self, kept: list[EvalLoopContainer], rows: list, last: bool, description: str) -> None:
        """One eval step's rows (all dp ranks'): batch_eval_metrics' call, and/or kept for the end."""
        if not rows:  # no dp rank had a row at this step (an empty eval set has no steps at all)
            return
        preds, labels, inputs = (_stack_rows([r[k] for r in rows]) for k in range(3))
        with_inputs = "inputs" in self.args.include_for_metrics
        if self.args.batch_eval_metrics and self.compute_metrics is not None:
            self._sp_batch_metrics = self.compute_metrics(
                EvalPrediction(predictions=preds, label_ids=labels, inputs=inputs if with_inputs else None),
                compute_result=last,
            )
        if not self.args.batch_eval_metrics or description == "Prediction":
            kept[0].add(preds)
            kept[1].add(labels)
            if with_inputs:
                kept[2].add(inputs)

    def _sp_metrics_dict(self, arrays: list, loss: float, items: int, prefix: str) -> dict:
        """compute_metrics' metrics (or batch_eval_metrics' last), prefixed, then seqpar's exact loss keys."""
        metrics = self._sp_batch_metrics if self.args.batch_eval_metrics else {}
        preds, labels, inputs = arrays
        if preds is not None and self.compute_metrics is not None and not self.args.batch_eval_metrics:
            metrics = self.compute_metrics(EvalPrediction(predictions=preds, label_ids=labels, inputs=inputs))
        metrics = {(k if k.startswith(f"{prefix}_") else f"{prefix}_{k}"): v
                   for k, v in denumpify_detensorize(dict(metrics or {})).items()}
        metrics.update({f"{prefix}_loss": loss, f"{prefix}_items": items})
        if self._sp_spec.stage == "sft":
            metrics[f"{prefix}_perplexity"] = math.exp(min(loss, 50.0))
        return metrics
