"""`trl.GRPOTrainer` drop-in that trains under exact sequence parallelism.

    trainer = SequenceParallelGRPOTrainer(model=model, reward_funcs=f, args=GRPOConfig(...), train_dataset=ds,
                                          processing_class=tok, sequence_parallel_size=2)  # was: GRPOTrainer(...)

Division of labour. TRL keeps: dataset handling (RepeatSampler order, prompt tokenisation, chat
templates), generation (its transformers path, its GenerationConfig), reward functions and reward
models, group advantages (scale_rewards, multi_objective_aggregation), metrics and logs. seqpar
changes, under SP:
- prompts go to DP ranks only: the sampler's batches are sharded over dp (accelerate's
  BatchSamplerShard with dp rank / size), so every rank of an SP group holds the same prompts;
- generation (TRL's transformers path, SP paused) is shared over the SP group: each rank samples a share
  of the prompts (whole groups of num_generations rows) under its own seed, the completion ids are
  all-gathered, and SP rank 0's RNG state goes to the group (TRL's later row shuffle agrees): every SP
  rank scores and trains identical completions (seqpar.hf.rollout_share.share_rollout). Image prompts
  (a Qwen VL model with its processor): each rank samples its share of the rows with their own images
  (seqpar.trl.grpo_media.media_rows); the completion rows keep their prompt's images (pixel_values /
  image_grid_thw / num_images of TRL's batch) and the loss runs on the full multimodal sequence
  (seqpar.data.VisionCollator, sp_vlm_inputs).
  FSDP2 and DeepSpeed ZeRO-3: every rank makes exactly one generate() per rollout (synced_gpus; ZeRO-3:
  inside TRL's one GatheredParameters, or its per-module fetches with ds3_gather_for_generation=False). Image
  prompts: under ZeRO-3 the tower runs on gathered weights (no collective; ds3_gather_for_generation=False is
  refused for a VL model); under FSDP2 every rank runs the tower once in its prefill, a blank image where its
  rows carry none (seqpar.hf.rollout_media), and once per training forward (seqpar.hf.vision_encode). Layer
  checkpointing is put back exactly after each
  generation on every rank (TRL re-enables it with the stored kwargs: every layer);
- TRL's gathers while scoring (`accelerator.gather`, `gather`, `gather_object`) and its
  `process_index` / `num_processes` see the dp ranks only: a gather over all ranks keeps the SP
  group's first rank's copy, so rewards and advantages are the SP group's first rank's values;
- TRL's un-sharded reference forward is skipped; the policy and (beta != 0) reference per-token
  log-probs and the loss run under SP in seqpar's shared step (`micro_batch_loss` stage "grpo") on
  SP-collated prompt + completion rows, completion tokens supervised;
- use_vllm=True (vllm_mode "colocate"): seqpar's colocated vLLM engine samples instead, the one `seqpar train`
  uses, with its per-row seeds (seqpar.trl.grpo_vllm: TRL's vLLM options mapped or refused).
Normalisation: seqpar's (seqpar.loss.grpo): denominators are the optimizer step's global counts
(sequences for "grpo" / "dr_grpo", completion tokens for "bnpo") over all micro-batches and dp ranks.
TRL normalises each micro-batch alone and averages; the two agree for "grpo" / "dr_grpo" (every
micro-batch has per_device_train_batch_size rows) and for "bnpo" when micro-batches hold equal
completion-token counts (always with one micro-batch per step and dp = 1).
Everything else is refused at construction (identically on every rank, before any collective).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import trl
from accelerate.data_loader import BatchSamplerShard
from accelerate.utils import gather as _accelerate_gather
from torch.utils.data import BatchSampler, DataLoader
from trl.trainer import grpo_trainer as _trl_grpo

from .. import comm
from .. import loss as L
from ..data import SequenceParallelCollator, VisionCollator
from ..errors import SeqParError
from ..hf.generation import (
    checkpointing_kept,
    fsdp_synced,
    is_sharded,
    sequence_parallel_paused,
)
from ..hf.prepare import frozen_reference
from ..hf.rollout_media import vision_tower_joined
from ..hf.rollout_share import share_rollout
from ..hf.trainer import SequenceParallelTrainer
from ..hf.trainer_args import pad_id
from ..hf.trainer_stack import agree_gathers
from ..hf.vision import is_vlm_model
from ..mesh import SequenceParallelMesh
from ..steps import ReferenceTokenLogps, StepSpec, micro_batch_loss
from .args import check_trl_rows, coerce_args, instantiate, refuse, refuse_common, refuse_moe_aux, sp_kwargs
from .collators import grpo_rows
from .grpo_media import has_pixels, media_rows, refuse_fetched_media, row_images
from .grpo_vllm import (
    add_rollout_logps,
    importance_sampling,
    log_rollout_diff,
    refuse_vllm_args,
    refuse_vllm_model,
    vllm_completions,
    vllm_rollout,
)

__all__ = ["SequenceParallelGRPOTrainer"]

class _GRPOBase(trl.GRPOTrainer):
    """trl.GRPOTrainer taking (and dropping) the data_collator seqpar's HF drop-in always passes: TRL's
    GRPO collator is the identity, and seqpar collates in compute_loss."""

    def __init__(self, *args: Any, data_collator: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


def _refuse_grpo(name: str, args: Any, kwargs: dict[str, Any], train_dataset: Any, eval_dataset: Any) -> None:
    """TRL GRPO options seqpar cannot run exactly under SP (SeqParError naming the alternative)."""
    checks = [
        (args.use_transformers_continuous_batching, "use_transformers_continuous_batching=True",
         "only the transformers generate() path is paused and broadcast", "drop it"),
        (args.loss_type not in L.GRPO_LOSS_TYPES, f"loss_type={args.loss_type!r}",
         "seqpar's GRPO step implements TRL's grpo / bnpo / dr_grpo only", "use loss_type='grpo' or 'bnpo'"),
        (args.num_iterations != 1, f"num_iterations={args.num_iterations}",
         "old log-probs would come from an un-sharded forward", "use num_iterations=1"),
        (args.steps_per_generation != args.gradient_accumulation_steps,
         f"steps_per_generation={args.steps_per_generation} != gradient_accumulation_steps="
         f"{args.gradient_accumulation_steps}", "seqpar normalises over the whole step's generation batch",
         "leave steps_per_generation / generation_batch_size unset"),
        (args.top_entropy_quantile < 1.0, f"top_entropy_quantile={args.top_entropy_quantile}",
         "the entropy quantile would need a gather over the sequence shards", "use top_entropy_quantile=1.0"),
        (args.importance_sampling_level != "token", f"importance_sampling_level={args.importance_sampling_level!r}",
         "seqpar's GRPO loss is token-level", "use importance_sampling_level='token'"),
        (args.off_policy_mask_threshold is not None, "off_policy_mask_threshold=", "not implemented", "drop it"),
        (args.entropy_coef != 0.0 or args.use_adaptive_entropy, "an entropy bonus (entropy_coef / "
         "use_adaptive_entropy)", "not implemented in seqpar's GRPO loss", "set entropy_coef=0.0"),
        (args.sync_ref_model, "sync_ref_model=True", "not implemented", "set sync_ref_model=False"),
        (args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32=True", "seqpar's fused head casts itself", "drop it"),
        (args.delta is not None, "delta= (two-sided clipping)", "not implemented", "drop delta"),
        (args.eval_strategy != "no" or eval_dataset is not None, "evaluation (eval_dataset / eval_strategy)",
         "GRPO evaluation generates and scores, which the SP drop-in does not run", "drop eval_dataset and "
         "evaluate with the stock trl.GRPOTrainer on one process"),
    ]
    for bad, what, why, instead in checks:
        if bad:
            raise refuse(name, what, why, instead)
    for key, what in (("tools", "tools="), ("rollout_func", "rollout_func="), ("environment_factory",
                                                                               "environment_factory=")):
        if kwargs.get(key):
            raise refuse(name, what, "multi-turn rollouts are not broadcast over the SP group",
                          "use single-turn generation")
    if train_dataset is not None and not hasattr(train_dataset, "__getitem__"):
        raise refuse(name, "an IterableDataset", "the SP sampler indexes the dataset", "use a map-style Dataset")


class _DPView:
    """The accelerator as TRL's scoring code must see it under SP: dp ranks only (see module docstring)."""

    def __init__(self, accelerator: Any, mesh: SequenceParallelMesh) -> None:
        self._acc, self._mesh = accelerator, mesh

    def __getattr__(self, name: str) -> Any:
        return getattr(self._acc, name)

    @property
    def process_index(self) -> int:
        return self._mesh.dp_rank

    @property
    def num_processes(self) -> int:
        return self._mesh.dp_size

    def gather(self, t: Any) -> Any:
        return _dp_gather(t, self._mesh)


def _dp_gather(t: Any, mesh: SequenceParallelMesh) -> Any:
    """accelerate's all-process gather, keeping each SP group's first rank's part (ranks are dp-major)."""
    g = _accelerate_gather(t)
    if mesh.sp_size == 1:
        return g
    if isinstance(t, torch.Tensor):
        parts = g.chunk(mesh.world_size) if t.dim() else list(g)
        parts = parts[::mesh.sp_size]
        return torch.cat(parts) if t.dim() else torch.stack(parts)
    raise SeqParError(f"cannot gather a {type(t).__name__} over dp")


def _dp_gather_object(obj: list) -> list:
    """TRL's gather_object over dp: each SP group's first rank's list (rank order dp-major)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return list(obj)
    parts = comm.all_gather_object(obj)
    sp = _CURRENT_SP[0]
    return [x for p in parts[::sp] for x in p]


_CURRENT_SP = [1]  # SP size for _dp_gather_object while TRL scores (set only inside _dp_scoring)


def _stop_if_failed(failed: tuple[int, str] | None) -> None:
    if failed is not None:
        rank, error = failed
        raise SeqParError(f"scoring failed on rank {rank} (every rank stops): {(error.splitlines() or [''])[0][:300]}: "
                          f"fix the reward function") from None


class SequenceParallelGRPOTrainer(SequenceParallelTrainer, _GRPOBase):
    """`trl.GRPOTrainer` with exact sequence parallelism (loss_type "grpo", "bnpo" or "dr_grpo").

    Arguments as trl.GRPOTrainer, plus seqpar's: sequence_parallel_size (default: world size),
    ulysses_degree, ring_degree, layout, mesh, fused_loss, loss_chunk_tokens, tiled_mlp, attention_kernel.
    Reference (beta != 0): TRL's (reloaded by model name; a PEFT policy with its adapter disabled),
    run under SP.
    """

    _sp_row_formats = ()  # TRL reads the raw rows: check_trl_rows checks them before TRL prepares them

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *,
                 sequence_parallel_size: int | None = None, ulysses_degree: int | None = None,
                 ring_degree: int | None = None, layout: str = "zigzag", mesh: SequenceParallelMesh | None = None,
                 fused_loss: bool = True, loss_chunk_tokens: int | None = None, tiled_mlp: bool | int = False,
                 peft_config: Any = None, **kwargs: Any) -> None:
        name = type(self).__name__
        args = coerce_args(args, trl.GRPOConfig, model, "GRPO")
        refuse_common(name, args, kwargs.pop("data_collator", None), kwargs)
        _refuse_grpo(name, args, kwargs, train_dataset, eval_dataset)
        refuse_vllm_args(name, args)
        check_trl_rows(name, "GRPO", args, train_dataset, None, kwargs)
        model = instantiate(model, args, peft_config)
        refuse_vllm_model(name, args, model)
        if args.beta != 0 and hasattr(model, "peft_config") and "ref" in model.peft_config:
            raise refuse(name, "a PEFT model with a 'ref' adapter", "seqpar's reference disables the adapter",
                          "pass a model without a 'ref' adapter")
        self._sp_den: L.GRPODenominators | None = None
        self._grpo_args = args  # _make_spec runs before the Trainer stores self.args
        self._sp_importance = importance_sampling(name, args)  # before use_vllm is off for TRL's __init__ below
        use_vllm, args.use_vllm = args.use_vllm, False  # TRL builds no engine of its own: seqpar's samples
        try:
            SequenceParallelTrainer.__init__(
                self, model, args, reward_funcs=reward_funcs, train_dataset=train_dataset, eval_dataset=None,
                processing_class=processing_class,
                **sp_kwargs(sequence_parallel_size, ulysses_degree, ring_degree, layout, mesh, fused_loss,
                             loss_chunk_tokens, tiled_mlp), **kwargs)
        finally:
            args.use_vllm = use_vllm
        self._sp_vllm = vllm_rollout(args, self.model) if use_vllm else None  # seqpar.trl.grpo_vllm
        refuse_moe_aux(self)
        vlm = is_vlm_model(self.model)  # image prompts: the full multimodal rows
        refuse_fetched_media(self, vlm)
        # TRL sized the generation batch with the world size; under SP only dp ranks take prompts.
        per_step = self._train_batch_size * args.steps_per_generation * self.sp_mesh.dp_size
        if per_step % args.num_generations:
            raise SeqParError(f"{name}: per_device_train_batch_size x steps_per_generation x dp ({per_step}) must be "
                              f"divisible by num_generations={args.num_generations} (dp = world / SP size)")
        args.generation_batch_size = per_step
        self._sp_reference, self._sp_vlm = self._grpo_reference(), vlm
        self._sp_collator = (VisionCollator if vlm else SequenceParallelCollator)(self.sp_mesh,
                                                                                 pad_id(self.model, self._tokenizer))

    # ------------------------------------------------------------------ set-up
    def _make_spec(self) -> StepSpec:
        a = self._grpo_args
        return StepSpec("grpo", beta=a.beta, loss_type=a.loss_type, **self.sp_prepare.head_kwargs(),
                        epsilon_low=a.epsilon, epsilon_high=a.epsilon_high,
                        max_completion_length=a.max_completion_length, temperature=a.temperature,
                        kl_ratio_correction=bool(getattr(a, "use_bias_correction_kl", False)),
                        importance=self._sp_importance)

    def _grpo_reference(self) -> ReferenceTokenLogps | None:
        """TRL's reference (None for beta 0), run under SP: its ref_model with seqpar attention, or the PEFT
        policy with the adapter disabled."""
        if self.beta == 0:
            return None
        kw = dict(**self.sp_prepare.head_kwargs(), temperature=self.temperature)
        if self.ref_model is None:
            return ReferenceTokenLogps(policy=self.model, **kw)
        ref = frozen_reference(self.accelerator.unwrap_model(self.ref_model), self.sp_mesh, self.sp_prepare)
        return ReferenceTokenLogps(ref_model=ref, **kw)

    # ------------------------------------------------------------------ data: prompts over dp only
    def _default_collator(self, model: torch.nn.Module, tok: Any, packing: bool, max_length: int | None) -> Any:
        return None  # TRL's GRPO collator is the identity; rows are SP-collated in compute_loss

    def get_train_dataloader(self) -> DataLoader:
        """TRL's RepeatSampler order, its generation batches sharded over dp ranks (not over all ranks)."""
        ds = self.train_dataset
        if ds is None:
            raise SeqParError("no dataset given: pass train_dataset=")
        if self.args.remove_unused_columns:
            ds = self._remove_unused_columns(ds, description="training")
        per_gen = self._train_batch_size * self.args.steps_per_generation
        batches = BatchSamplerShard(BatchSampler(self._get_train_sampler(ds), per_gen, self.args.dataloader_drop_last),
                                    num_processes=self.sp_mesh.dp_size, process_index=self.sp_mesh.dp_rank,
                                    split_batches=False, even_batches=True)
        return DataLoader(ds, batch_sampler=batches, collate_fn=self.data_collator,
                          num_workers=self.args.dataloader_num_workers)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> None:
        return None  # raw prompts here; the step's counts come with its generation batch (_sp_den)

    # ------------------------------------------------------------------ generation and scoring
    @contextlib.contextmanager
    def _dp_scoring(self) -> Iterator[None]:
        """TRL's scoring sees dp ranks only and skips its un-sharded reference forward (beta read as 0)."""
        acc, beta = self.accelerator, self.beta
        _CURRENT_SP[0] = self.sp_mesh.sp_size
        saved = {k: getattr(_trl_grpo, k) for k in ("gather", "gather_object")}
        try:
            self.accelerator, self.beta = _DPView(acc, self.sp_mesh), 0.0
            _trl_grpo.gather = lambda t: _dp_gather(t, self.sp_mesh)
            _trl_grpo.gather_object = _dp_gather_object
            yield
        finally:
            self.accelerator, self.beta = acc, beta
            for k, v in saved.items():
                setattr(_trl_grpo, k, v)
            _CURRENT_SP[0] = 1

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        # TRL gathers the images for its logs only on ranks whose rows carry some: a dp rank with text rows only would
        # leave the others waiting. Every rank gathers them here instead (None for a row without).
        log_images, self.log_multimodal = self.log_multimodal, False
        try:
            with self._dp_scoring():
                out = super()._generate_and_score_completions(inputs)
                if log_images and self._sp_vlm:
                    gathered = _dp_gather_object(row_images(inputs))
                    if any(gathered):
                        self._logs["images"].extend(gathered)
        finally:
            self.log_multimodal = log_images
        # One generation batch = one optimizer step (steps_per_generation == grad accum, num_iterations 1):
        # its global counts are the step's GRPO denominators.
        local = torch.stack([torch.tensor(out["completion_mask"].shape[0]), out["completion_mask"].sum().cpu()])
        self._sp_den = L.GRPODenominators.from_counts(L.global_token_count(local, self.sp_mesh).cpu(),
                                                      self.args.max_completion_length)
        return out

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        """TRL's scoring. Each dp rank scores its own rows, so a reward function may fail on one rank only: the
        ranks agree on the outcome before TRL's gather (one small all-gather) and all stop with the same
        SeqParError, where the others used to wait in the gather until the timeout."""
        gather, agreed = _trl_grpo.gather, []

        def gather_after_agreeing(t: Any) -> Any:
            agreed.append(True)
            _stop_if_failed(comm.agree_on_error(None))
            return gather(t)

        _trl_grpo.gather = gather_after_agreeing
        try:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        except Exception as e:
            if not agreed:
                _stop_if_failed(comm.agree_on_error(f"{type(e).__name__}: {e}"))
            raise
        finally:
            _trl_grpo.gather = gather

    def _generate_single_turn(self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int,
                              has_tool_images: bool = False) -> Any:
        """TRL's generation, SP paused, on every rank of the SP group: each samples a share of the rows (whole
        groups of num_generations rows) with their own images (`media_rows`), and the shares are all-gathered
        (`share_rollout`). A VL model under FSDP2 runs its tower once in every rank's generate(), a blank image
        where a rank's rows carry none (`vision_tower_joined`): the vision blocks' gathers match on every rank.
        Every rank's layer checkpointing is put back exactly as it was afterwards (TRL re-enables it with the
        stored kwargs, which would checkpoint every layer whatever every_n_layers said)."""
        n = len(prompt_ids)
        if self._sp_vllm is not None:  # seqpar's vLLM engine (seqpar.trl.grpo_vllm): every rank, any SP size
            return vllm_completions(self, prompt_ids, num_generations)

        def run(rows: range) -> Any:
            imgs, fields = media_rows(images, multimodal_fields, rows, n)
            joined = vision_tower_joined(self.model, has_pixels(fields)) if self._sp_vlm else contextlib.nullcontext()
            with (checkpointing_kept(self.model), sequence_parallel_paused(self.model), fsdp_synced(self.model),
                  joined):
                return super(SequenceParallelGRPOTrainer, self)._generate_single_turn(
                    [prompt_ids[i] for i in rows], imgs, fields, num_generations, has_tool_images)

        if self.sp_mesh.sp_size == 1:
            return run(range(n))
        return share_rollout(run, n, num_generations, self.sp_mesh, self.accelerator.device, is_sharded(self.model))

    # ------------------------------------------------------------------ loss under SP
    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if return_outputs:
            raise SeqParError(f"{type(self).__name__}.compute_loss(return_outputs=True) is not supported "
                              "(logits are sharded over the sequence)")
        batch = self._sp_collator(grpo_rows(inputs))
        batch["advantages"] = inputs["advantages"].detach().float().cpu()
        add_rollout_logps(batch, inputs, self.sp_mesh)  # use_vllm: the engine's log-probs, for the mismatch metrics
        den = self._sp_den
        if den is None:
            raise SeqParError("GRPO compute_loss ran before a generation batch was scored")
        agree_gathers(model, batch, self.sp_mesh)  # ZeRO-3: the same parameter gathers on every rank
        share, metrics = micro_batch_loss(model, batch, den, self.sp_mesh, self._sp_spec, self._sp_reference)
        mode = "train" if model.training else "eval"
        log_rollout_diff(self._metrics[mode], metrics)
        for k, v in metrics.items():
            self._metrics[mode][k].append(float(v))
        return share * self._grad_factor(model)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._sp_vllm is not None:
                self._sp_vllm.close()  # the engine and vLLM's process groups (the next train() starts a new one)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict:
        raise SeqParError(f"{type(self).__name__}.evaluate() is not supported (GRPO evaluation generates and "
                          "scores): evaluate with the stock trl.GRPOTrainer on one process")
