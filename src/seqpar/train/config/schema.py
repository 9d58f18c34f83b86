"""The run's configuration as pydantic models: every field, its default, and every rule knowable from
the YAML alone (degrees multiply to the SP size, LoRA fields, DPO loss type, GRPO batch shape, ...).
Unknown keys are refused; every message names the fix. Loading: config/load.py; checks that need the
world size or the model: config/checks.py.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from ...mesh import check_divides
from .base import StrictModel
from .grpo_checks import check_grpo
from .memory import FSDPSpec, MemorySpec
from .rollout import RolloutSpec

__all__ = ["TrainConfig", "ModelSpec", "DatasetSpec", "SequenceParallelSpec", "DPOSpec", "GRPOSpec", "FinetuningSpec",
           "OptimizerSpec", "ScheduleSpec", "CheckpointSpec", "ExportSpec", "MemorySpec", "FSDPSpec", "RolloutSpec"]


_Strict = StrictModel


class ModelSpec(_Strict):
    """`name`: an HF hub id or local directory, "smollm2" (bundled SmolLM2-135M-Instruct GGUF), or
    "tiny:<arch>" (random tiny model for tests; `kwargs` go to seqpar.hf.tiny_model, e.g. num_heads)."""

    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    tokenizer: str | None = None  # defaults to the model's own tokenizer


class DatasetSpec(_Strict):
    """A local JSONL / JSON / Parquet file (or a directory of them), read with `datasets`.

    format: auto (from the fields), text {"text"}, instruction (Alpaca {"instruction", "input"?, "output",
    "system"?, "history"?} or TRL {"prompt", "completion"}), chat {"messages": [{"role", "content"}]},
    sharegpt {"conversations": [{"from", "value"}]}, dpo {"prompt"?, "chosen", "rejected"}, tokenized
    {"input_ids", optional "labels"} (seqpar.train.dataset.formats). Relative `path` and `chat_template` file
    paths are relative to the config file.
    train_on_prompt: supervise prompt tokens too; mask_history: supervise only the last assistant turn.
    chat_template: a Jinja template string, or a path to a .jinja file, replacing the tokenizer's own.
    max_prompt_length / truncation_mode (DPO): cut longer prompts to that many tokens, keeping their end
    (keep_end) or start (keep_start); pairs whose prompt still reaches max_length are skipped (counted).
    """

    path: str
    format: Literal["auto", "text", "instruction", "chat", "sharegpt", "dpo", "tokenized"] = "auto"
    max_length: int = Field(gt=0)
    packing: bool = False
    shuffle: bool = True
    train_on_prompt: bool = False
    mask_history: bool = False
    chat_template: str | None = None
    max_prompt_length: int | None = Field(default=None, gt=0)
    truncation_mode: Literal["keep_end", "keep_start"] = "keep_end"

    @model_validator(mode="after")
    def _prompt_room(self) -> DatasetSpec:
        if self.max_prompt_length is not None and self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"max_prompt_length={self.max_prompt_length} leaves no room for the response within "
                f"max_length={self.max_length}: set it below {self.max_length}"
            )
        return self


class SequenceParallelSpec(_Strict):
    """size: an SP degree, or "dynamic" (length-aware SP: each row at the degree its length needs, at most
    max_local_tokens tokens per rank; docs/training.md, "Length-aware SP")."""

    size: int | Literal["dynamic"] = Field(default=1)
    ulysses_degree: int | None = Field(default=None, ge=1)
    ring_degree: int | None = Field(default=None, ge=1)
    layout: Literal["zigzag", "contiguous"] = "zigzag"
    # hybrid models under a ring: how the recurrent layers' states travel (seqpar.init_mesh's state_passing)
    state_passing: Literal["chain", "scan"] = "chain"
    max_local_tokens: int | None = Field(default=None, ge=1)  # size: dynamic: tokens per rank and micro-batch

    @property
    def dynamic(self) -> bool:
        return self.size == "dynamic"

    @model_validator(mode="after")
    def _degrees(self) -> SequenceParallelSpec:
        if self.dynamic:
            return self._dynamic_rules()
        if self.size < 1:
            raise ValueError(f"size={self.size}: use a degree >= 1, or dynamic")
        if self.max_local_tokens is not None:
            raise ValueError("max_local_tokens is read with size: dynamic only: remove it, or set "
                             "size: dynamic")
        u, r, s = self.ulysses_degree, self.ring_degree, self.size
        for name, val in (("ulysses_degree", u), ("ring_degree", r)):
            if val is not None:  # a SeqParError is a ValueError: pydantic reports it as the field's error
                check_divides(val, s, f"sequence_parallel.{name}={val} must divide size={s}: use one of {{ok}}")
        if u is not None and r is not None and u * r != s:
            raise ValueError(
                f"sequence_parallel: ulysses_degree={u} x ring_degree={r} = {u * r} != size={s}: "
                f"set size: {u * r}, or pick degrees whose product is {s}"
            )
        return self

    def _dynamic_rules(self) -> SequenceParallelSpec:
        if self.max_local_tokens is None:
            raise ValueError("size: dynamic needs max_local_tokens: N (tokens per rank and "
                             "micro-batch; `seqpar plan --lengths ...` proposes one from the memory budget)")
        if self.ulysses_degree is not None or self.ring_degree is not None:
            raise ValueError("size: dynamic chooses ulysses x ring per degree (as a size alone "
                             "does): remove ulysses_degree / ring_degree, or use a fixed size")
        return self


class DPOSpec(_Strict):
    beta: float = Field(default=0.1, gt=0)
    loss_type: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"
    gamma: float = 0.5  # SimPO margin


class GRPOSpec(_Strict):
    """`stage: grpo` (docs/grpo.md). reward_funcs: "module:function" import paths (seqpar:<name> for the
    built-ins of seqpar.train.grpo.rewards); beta: KL coefficient (0: no reference model); epsilon /
    epsilon_high: the PPO clip range [1 - epsilon, 1 + epsilon_high] (epsilon_high None: epsilon)."""

    reward_funcs: list[str] = Field(min_length=1)
    reward_weights: list[float] | None = None
    num_generations: int = Field(default=4, ge=2)
    max_prompt_length: int = Field(default=256, ge=1)
    max_completion_length: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0: off
    beta: float = Field(default=0.0, ge=0)
    epsilon: float = Field(default=0.2, gt=0, lt=1)
    epsilon_high: float | None = Field(default=None, gt=0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo"] = "grpo"
    scale_rewards: Literal["group", "none"] = "group"
    # optimizer steps per rollout (TRL's num_iterations): steps 2..n reuse it, the PPO ratio against its old log-probs
    num_iterations: int = Field(default=1, ge=1)
    # TRL's vllm_importance_sampling_mode (seqpar.loss.importance): the policy loss x the ratio exp(old - sampler),
    # per token or per sequence, truncated to or masked outside [importance_min, importance_cap]; "tis" =
    # "token_truncate"
    importance_correction: Literal["none", "tis", "token_truncate", "token_mask", "sequence_truncate",
                                   "sequence_mask"] = "none"
    importance_cap: float | None = Field(default=3.0, gt=0)  # TRL's vllm_importance_sampling_clip_max (None: none)
    importance_min: float | None = Field(default=None, ge=0)  # TRL's vllm_importance_sampling_clip_min
    # k3 KL x the differentiable importance ratio (TRL's use_bias_correction_kl; same value on-policy)
    kl_ratio_correction: bool = False
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)  # the sampling engine (config/rollout.py)
    log_rollouts: bool = False  # one row per completion in output_dir/rollouts.jsonl

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_bool(cls, v: Any) -> Any:
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v  # TRL's old bool form

    @model_validator(mode="after")
    def _checks(self) -> GRPOSpec:
        if self.importance_min is not None and self.importance_cap is not None and (
                self.importance_min > self.importance_cap):
            raise ValueError(f"grpo.importance_min={self.importance_min} > grpo.importance_cap={self.importance_cap}: "
                             "the bounds are [importance_min, importance_cap]")
        if self.importance_correction in ("tis", "token_truncate", "sequence_truncate") and (
                self.importance_min is None and self.importance_cap is None):
            raise ValueError(f"grpo.importance_correction: {self.importance_correction} truncates the ratio, so it "
                             "needs a bound: set grpo.importance_cap (e.g. 3.0) or grpo.importance_min")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} entries for {len(self.reward_funcs)} "
                             "reward_funcs: give one weight per function, or drop reward_weights")
        for p in self.reward_funcs:
            if p.count(":") != 1 or not all(p.split(":")):
                raise ValueError(f"reward_funcs entry {p!r}: write it as 'package.module:function' or seqpar:<name>")
        return self


class FinetuningSpec(_Strict):
    method: Literal["full", "lora"] = "full"
    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    # A list of module names, or "all" (every linear layer of the decoder except lm_head: peft's "all-linear").
    targets: list[str] | Literal["all-linear"] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    @field_validator("targets", mode="before")
    @classmethod
    def _all(cls, v: Any) -> Any:
        if isinstance(v, str):  # LLaMA-Factory style: "all" or "q_proj,v_proj"
            names = [t.strip() for t in v.split(",") if t.strip()]
            return "all-linear" if names in (["all"], ["all-linear"]) else names
        return v


class OptimizerSpec(_Strict):
    """implementation: torch's update path. "fused" (default): one in-place kernel per tensor on CPUs and GPUs,
    no temporaries (on a CPU ~5x faster than the per-tensor loop, on a GPU the fastest); "foreach": the
    multi-tensor path, one temporary the size of the trainable parameters; "for_loop": one tensor at a time.
    SGD under "fused" runs torch's default path (its fused kernel has no FSDP2 support)."""

    name: Literal["adamw", "sgd"] = "adamw"
    implementation: Literal["fused", "foreach", "for_loop"] = "fused"
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = Field(default=None, gt=0)


class ScheduleSpec(_Strict):
    """warmup_ratio: warmup over ceil(ratio x total steps) steps (instead of warmup_steps)."""

    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    warmup_ratio: float | None = Field(default=None, ge=0, lt=1)

    @model_validator(mode="after")
    def _one_warmup(self) -> ScheduleSpec:
        if self.warmup_ratio is not None and self.warmup_steps:
            raise ValueError("set schedule.warmup_steps or schedule.warmup_ratio, not both")
        return self

    def warmup(self, total_steps: int) -> int:
        return math.ceil(self.warmup_ratio * total_steps) if self.warmup_ratio is not None else self.warmup_steps


class CheckpointSpec(_Strict):
    every: int = Field(default=0, ge=0)  # 0 = only at the end (when save_final)
    save_final: bool = False
    resume: bool = True  # resume from output_dir's latest checkpoint when one exists
    keep_last: int = Field(default=2, ge=1)


class ExportSpec(_Strict):
    """What `seqpar train` writes to <output_dir>/final/ at the end (docs/training.md, "Outputs").

    final: the trained model in Hugging Face format (full fine-tuning: save_pretrained safetensors +
      config; LoRA: a PEFT adapter directory) plus the tokenizer.
    merged_lora: LoRA only: also <output_dir>/final/merged/, the base with the adapter merged in.
    """

    final: bool = True
    merged_lora: bool = False


class TrainConfig(_Strict):
    model: ModelSpec
    dataset: DatasetSpec
    stage: Literal["sft", "dpo", "grpo"] = "sft"
    dpo: DPOSpec = Field(default_factory=DPOSpec)
    grpo: GRPOSpec | None = None  # required with stage: grpo
    finetuning: FinetuningSpec = Field(default_factory=FinetuningSpec)
    sequence_parallel: SequenceParallelSpec = Field(default_factory=SequenceParallelSpec)
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    precision: Literal["fp32", "bf16", "bf16-pure"] = "fp32"  # bf16: fp32 master weights; bf16-pure: none
    # the local attention kernel (docs/gpu.md): auto picks per device, dtype, head_dim and GPU; logged once per run
    attention_kernel: Literal["auto", "flash", "cudnn", "efficient", "math", "cpu", "cpu_cuda_workspace", "cuda",
                              "cuda_efficient"] = "auto"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    micro_batch_size: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    # Rows per step over all dp ranks (dp x micro_batch_size x grad_accum); when set, grad_accum follows each launch's
    # dp, so a resume at another world / dp size keeps the global batch (checks.py, resolve_grad_accum). Setting
    # grad_accum as well is refused; a dump leaves grad_accum out then (it is derived, not an input).
    global_batch_size: int | None = Field(default=None, ge=1)
    # When replicated gradients (no FSDP) are summed over dp x sp: "overlap" during the step's last backward
    # (seqpar.loss.OverlappedGradSum), "after_backward" after it, "auto" overlaps on CUDA / NCCL streams and sums
    # after backward on CPU / gloo, where the transfers take the cores backward computes on (measured slower).
    grad_sync: Literal["auto", "overlap", "after_backward"] = "auto"
    # Exactly one of max_steps / num_epochs (neither: max_steps 10); see steps_for_epochs for the rule.
    max_steps: int | None = Field(default=None, ge=1)
    num_epochs: float | None = Field(default=None, gt=0)
    eval_dataset: DatasetSpec | None = None  # fields not given are taken from `dataset`
    eval_every: int = Field(default=0, ge=0)  # steps between evals; 0 = only after the last step
    report_to: list[Literal["tensorboard"]] = Field(default_factory=list)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    # A fresh start over an earlier run's results in output_dir replaces them only when true (lifecycle/output_dir.py)
    overwrite_output_dir: bool = False
    # A step whose global loss or gradient norm is NaN/inf updates nothing; this many in a row stop the run.
    max_consecutive_nonfinite: int = Field(default=3, ge=1)
    # How long a collective waits for a rank that does not arrive before it fails (the process group, every
    # SP / dp subgroup, the FSDP2 mesh); HF's ddp_timeout default. Not compared on resume.
    timeout_minutes: float = Field(default=30.0, gt=0)
    output_dir: str = "runs/seqpar"  # relative: to the config file when loaded from one, else to the cwd
    seed: int = 0
    progress: bool = True

    @property
    def collective_timeout(self) -> timedelta:
        """timeout_minutes as the timedelta torch.distributed takes."""
        return timedelta(minutes=self.timeout_minutes)

    @model_validator(mode="before")
    @classmethod
    def _eval_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("eval_dataset") is not None and isinstance(data.get("dataset"), dict):
            ev = data["eval_dataset"]
            ev = {"path": ev} if isinstance(ev, str) else ev
            if isinstance(ev, dict):
                if "chat_template" in ev:
                    raise ValueError("eval_dataset.chat_template: set chat_template on dataset (it applies to both)")
                base = {k: v for k, v in data["dataset"].items() if k != "path"}
                data = {**data, "eval_dataset": {**base, **ev}}
        return data

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v: Any) -> Any:
        if v is None or v == "none":
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("model", mode="before")
    @classmethod
    def _model_str(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return {"enabled": v}
        if isinstance(v, dict) and "enabled" not in v:
            return {"enabled": True, **v}  # `fsdp: {offload: true}` means FSDP on
        return v

    @field_validator("sequence_parallel", mode="before")
    @classmethod
    def _sp_int(cls, v: Any) -> Any:
        return {"size": v} if isinstance(v, int) else v

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if self.global_batch_size is not None:
            out.pop("grad_accum", None)  # follows global_batch_size at each launch's dp: a reload must not see both
        return out

    @model_validator(mode="after")
    def _cross(self) -> TrainConfig:
        if self.max_steps is not None and self.num_epochs is not None:
            raise ValueError("set max_steps or num_epochs, not both")
        if self.global_batch_size is not None and "grad_accum" in self.model_fields_set:
            raise ValueError(
                f"set global_batch_size or grad_accum, not both: global_batch_size={self.global_batch_size} fixes the "
                f"rows per step and grad_accum follows each launch's dp (global_batch_size / (dp x micro_batch_size)), "
                f"so grad_accum={self.grad_accum} would not be used: drop one of them"
            )
        if self.max_steps is None and self.num_epochs is None:
            self.max_steps = 10
        if self.stage == "dpo" and self.dataset.packing:
            raise ValueError(
                "dataset.packing is not supported with stage: dpo (pairs are padded rows): set packing: false"
            )
        if self.stage == "grpo" or self.grpo is not None:
            check_grpo(self)
        if self.grad_sync == "overlap" and self.precision == "bf16" and not self.fsdp.enabled:
            raise ValueError(
                "grad_sync: overlap needs each gradient while backward runs, but precision: bf16 sums the fp32 "
                "master gradients made after it: set grad_sync: auto (or after_backward), or precision: bf16-pure"
            )
        if self.sequence_parallel.dynamic:
            _check_dynamic(self)
        if self.dataset.packing and self.micro_batch_size != 1:
            raise ValueError(
                "with dataset.packing, a micro-batch is one packed row of up to max_length tokens: "
                "set micro_batch_size: 1 (raise dataset.max_length or grad_accum for more tokens per step)"
            )
        return self


def _check_dynamic(cfg: TrainConfig) -> None:
    """sequence_parallel: {size: dynamic} rules that involve other sections."""
    if cfg.dataset.packing:
        raise ValueError("sequence_parallel: size: dynamic packs the short rows itself, per rank, up to "
                         "max_local_tokens: set dataset.packing: false")
    if cfg.grad_sync == "overlap":
        raise ValueError("grad_sync: overlap posts the gradient sums during each rank's last backward, but with size: "
                         "dynamic ranks run different numbers of slots: set grad_sync: auto (sums after backward)")
