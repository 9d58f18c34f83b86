"""Evaluation of the Trainer drop-ins under SP (mixed into seqpar.hf.trainer.SequenceParallelTrainer)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader

from .. import loss as L
from ..errors import SeqParError
from ..steps import count_items, micro_batch_loss


class SequenceParallelEvaluation:
    """evaluate() / predict() for SequenceParallelTrainer: every eval row counted exactly once, eval_loss global."""

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
    @torch.no_grad()
    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> dict:
        """Global token-averaged eval loss (pair-averaged for DPO), computed sequence-parallel."""
        loader = self.get_eval_dataloader(eval_dataset)
        n_pad = self._eval_padding_batches(len(loader.dataset), len(loader.batch_sampler))
        model = self.model
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64)
        items = torch.zeros((), dtype=torch.long)
        try:
            padding = [(self.data_collator([loader.dataset[0]]), False)] * n_pad
            for batch, counted in [*((b, True) for b in loader), *padding]:
                batch = self._prepare_inputs(batch)
                # Denominator 1 gives this rank's share of the SUM of losses; normalise once at the end.
                share, _ = micro_batch_loss(model, batch, 1, self.sp_mesh, self._sp_spec, self._sp_reference)
                if counted:  # a padding batch only keeps this rank's collectives matched with longer ranks'
                    total += share.detach().double().cpu()
                    items += count_items([batch], self._sp_spec.stage).cpu()
        finally:
            model.train(was_training)
        total = L.global_loss(total, self.sp_mesh)
        items = L.global_token_count(items, self.sp_mesh)
        loss = float(total) / max(int(items), 1)
        metrics = {f"{metric_key_prefix}_loss": loss, f"{metric_key_prefix}_items": int(items)}
        if self._sp_spec.stage == "sft":
            metrics[f"{metric_key_prefix}_perplexity"] = math.exp(min(loss, 50.0))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


    def predict(self, test_dataset: Any, ignore_keys: Any = None, metric_key_prefix: str = "test") -> Any:
        raise SeqParError(
            f"{type(self).__name__}.predict() is not supported: under SP each rank holds logits for its shard of "
            "the sequence only. Use evaluate() for the loss / perplexity, or predict with the stock "
            "transformers.Trainer (or model.generate) on one process after training"
        )

    def prediction_step(self, *args: Any, **kwargs: Any) -> Any:
        raise SeqParError(
            f"{type(self).__name__}.prediction_step() is not supported (logits are sharded over the sequence): "
            "use evaluate() for the loss, or the stock transformers.Trainer on one process for predictions"
        )
