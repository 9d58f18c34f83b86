"""The TRL GRPO drop-in's `use_vllm=True`: TRL's vLLM options mapped onto seqpar's colocated vLLM engine (the one
`seqpar train` uses: seqpar.hf.vllm_rollout / seqpar.hf.vllm_engine), or refused before any collective.

TRL's own engine (trl.generation.VLLMGeneration) is never built: TRL's __init__ runs with use_vllm off and the
drop-in samples in `_generate_single_turn` with seqpar's engine instead. One engine per rank, in the process; before
every rollout each rank pushes the policy's current weights (plain, DDP, FSDP2, ZeRO-3, LoRA merged); each SP rank
samples a share of the generation batch's rows and the shares are all-gathered. Row r of the step's generation batch
(all dp ranks' rows in order; TRL's sampler repeats each prompt num_generations times in a row) is generation r % G of
prompt r // G and is sampled with seqpar's row seed for that position (`trl_row_seeds`): the completions depend
neither on the SP nor on the dp size, and equal `seqpar train`'s for the same prompts in the same order.

Mapped: vllm_mode "colocate"; vllm_gpu_memory_utilization; vllm_max_model_length (None: the model's
max_position_embeddings, as vLLM infers it); vllm_enable_sleep_mode (as `grpo.rollout.sleep`: on CUDA the engine
sleeps between rollouts; a no-op on CPU, said once); vllm_model_impl "vllm" / "auto";
vllm_importance_sampling_correction with its four modes and clip_min / clip_max (seqpar.loss.importance, in seqpar's
exact SP loss); temperature, top_p, top_k, max_completion_length; TRL's eos_token_ids. The engine's log-probs of the
sampled tokens reach the loss batch ("rollout_logps"): the step's mismatch with the trainer's exact SP log-probs is
logged as rollout_logprob_diff_max / _mean.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import SeqParError
from ..hf.vllm_rollout import VLLMRollout, VLLMSettings, placed_rollout_logps, trl_row_seeds
from ..loss.importance import IMPORTANCE_MODES, ImportanceSampling
from ..unwrap import base_model

__all__ = ["refuse_vllm_args", "refuse_vllm_model", "importance_sampling", "vllm_rollout",
           "vllm_completions", "add_rollout_logps", "log_rollout_diff"]


def _refused(name: str, what: str, why: str, instead: str) -> SeqParError:
    return SeqParError(f"{name}: {what} is not supported with use_vllm=True ({why}): {instead}")


def refuse_vllm_args(name: str, args: Any) -> None:
    """TRL vLLM options seqpar's engine cannot run (one line each; only with use_vllm=True)."""
    if not args.use_vllm:
        return
    only = "seqpar's engine samples with temperature / top_p / top_k only, as seqpar train's"
    checks = [
        (args.vllm_mode != "colocate", f"vllm_mode={args.vllm_mode!r}", "a separate vLLM server fed over the "
         "network is not built yet", "use vllm_mode='colocate' (an engine inside every training process)"),
        (args.vllm_tensor_parallel_size != 1, f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}",
         "one engine per rank, each sampling its SP rank's share of the rows, is the only layout yet",
         "set vllm_tensor_parallel_size=1"),
        (args.vllm_model_impl == "transformers", "vllm_model_impl='transformers'", "the weight push by name runs "
         "against vLLM's own model implementations", "use vllm_model_impl='vllm'"),
        (args.vllm_structured_outputs_regex is not None, "vllm_structured_outputs_regex=", only, "drop it"),
        (bool(args.generation_kwargs), "generation_kwargs=", only + " (a seed there would make completions "
         "depend on the layout)", "drop generation_kwargs"),
        (args.min_p not in (None, 0.0), f"min_p={args.min_p}", only, "drop min_p"),
        (args.repetition_penalty != 1.0, f"repetition_penalty={args.repetition_penalty}", only,
         "use repetition_penalty=1.0"),
        (args.vllm_max_model_length is not None and args.vllm_max_model_length <= args.max_completion_length,
         f"vllm_max_model_length={args.vllm_max_model_length}", "it must hold a prompt and max_completion_length="
         f"{args.max_completion_length} tokens", "raise it, or leave it None (the model's max_position_embeddings)"),
    ]
    for bad, what, why, instead in checks:
        if bad:
            raise _refused(name, what, why, instead)
    importance_sampling(name, args)  # TRL's importance-sampling options: refused here, before any collective


def importance_sampling(name: str, args: Any) -> ImportanceSampling | None:
    """TRL's vLLM importance-sampling options as seqpar's loss correction (seqpar.loss.importance; None: off):
    vllm_importance_sampling_mode (all four), _clip_min, _clip_max (TRL's deprecated vllm_importance_sampling_cap
    is copied into it by GRPOConfig)."""
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return None
    mode, lo, hi = (args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_min,
                    args.vllm_importance_sampling_clip_max)
    if mode not in IMPORTANCE_MODES:
        raise _refused(name, f"vllm_importance_sampling_mode={mode!r}", "TRL knows no such mode",
                       f"use one of {IMPORTANCE_MODES}")
    if mode.endswith("truncate") and lo is None and hi is None:
        raise _refused(name, f"vllm_importance_sampling_mode={mode!r} without bounds", "truncating needs a bound",
                       "set vllm_importance_sampling_clip_max, e.g. 3.0")
    try:
        return ImportanceSampling.from_name(mode, lo, hi)
    except SeqParError as e:
        raise _refused(name, f"vllm_importance_sampling_clip_min={lo}, vllm_importance_sampling_clip_max={hi}",
                       str(e), "use 0 <= clip_min <= clip_max, clip_max > 0") from None


def refuse_vllm_model(name: str, args: Any, model: torch.nn.Module) -> None:
    """What the engine cannot run with this model or these ranks (vLLM missing, its architecture, head_dim on CPU,
    a vision-language model, ranks that are threads): seqpar.hf.vllm_engine's checks, in the drop-in's words."""
    if not args.use_vllm:
        return
    from ..hf.vllm_engine import check_process_ranks
    from ..hf.vllm_models import check_vllm_model

    option = f"{name}: use_vllm=True"
    check_process_ranks(option)
    check_vllm_model(base_model(model).config, on_cuda=torch.cuda.is_available(), option=option,
                     instead="use_vllm=False", tiny_hint="head_dim=32 in its config")


def vllm_rollout(args: Any, model: torch.nn.Module) -> VLLMRollout:
    """The engine's holder for this rank (started at the first rollout) with TRL's settings."""
    c = base_model(model).config
    c = getattr(c, "text_config", None) or c
    return VLLMRollout(VLLMSettings(
        max_model_len=int(args.vllm_max_model_length or c.max_position_embeddings),
        max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization, enforce_eager=True,
        sleep=args.vllm_enable_sleep_mode, sleep_option="vllm_enable_sleep_mode"))


def vllm_completions(trainer: Any, prompt_ids: list[list[int]],
                     num_generations: int) -> tuple[list[list[int]], list[list[float]]]:
    """TRL's `_generate_single_turn` result (completion ids, their log-probs) from seqpar's engine, for this dp
    rank's rows of the generation batch."""
    mesh = trainer.sp_mesh
    seeds = trl_row_seeds(len(prompt_ids), num_generations, trainer.args.seed, trainer.state.global_step, mesh.dp_rank)
    return trainer._sp_vllm.for_rows(
        trainer.model, mesh, prompt_ids, seeds, unit=num_generations, max_new_tokens=trainer.max_completion_length,
        temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k or 0,
        eos_token_id=list(trainer.eos_token_ids))


def add_rollout_logps(batch: dict[str, Any], inputs: dict[str, Any], mesh: Any) -> None:
    """The engine's log-probs (TRL's "sampling_per_token_logps", [B, C] right-padded) placed at the collated SP
    batch's target positions ("rollout_logps", for the mismatch metrics)."""
    lps = inputs.get("sampling_per_token_logps")
    if lps is None:
        return
    lens = [int(n) for n in inputs["prompt_mask"].sum(1).tolist()]
    rows = [row[:int(n)].tolist() for row, n in zip(lps.float().cpu(), inputs["completion_mask"].sum(1).tolist())]
    batch["rollout_logps"] = placed_rollout_logps(lens, rows, batch["shift_labels"].shape[1] * mesh.sp_size, mesh)


def log_rollout_diff(store: dict[str, list[float]], metrics: dict[str, Any]) -> None:
    """The mismatch metrics into TRL's metric lists (which it averages per log): rollout_logprob_diff_mean per
    micro-batch, rollout_logprob_diff_max kept as one value, the max since the last log."""
    total, count = metrics.pop("rollout_logprob_diff_sum", None), metrics.pop("rollout_logprob_diff_count", None)
    top = metrics.pop("rollout_logprob_diff_max", None)
    if total is None:
        return
    store["rollout_logprob_diff_mean"].append(float(total) / max(float(count), 1e-30))
    seen = store["rollout_logprob_diff_max"]
    seen[:] = [max([float(top), *seen])]
