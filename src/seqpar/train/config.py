"""Training configuration (YAML -> pydantic), validated before any process group exists.

Two layers of checks:
- `TrainConfig` field validators: everything knowable from the YAML alone (degrees multiply to the
  SP size, LoRA fields, DPO loss type, ...).
- `validate_for_launch(cfg, world_size)`: what needs the world size, the model's head counts and the
  dataset on disk (sp dividing world, model known, dataset fields, max_length reachable). It reads
  files but never touches torch.distributed, so a bad config fails on every rank with the same message
  before the first collective.
Every message names the fix.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import SeqParError
from ..layout import required_multiple
from ..mesh import auto_degrees, divisors

__all__ = [
    "TrainConfig",
    "ModelSpec",
    "DatasetSpec",
    "SequenceParallelSpec",
    "MemorySpec",
    "FSDPSpec",
    "ExportSpec",
    "load_config",
    "config_from_dict",
    "validate_for_launch",
    "resolve_sp_degrees",
    "steps_for_epochs",
    "with_total_steps",
]


class _Strict(BaseModel):
    # Unknown keys are typos: refuse them instead of silently ignoring a setting.
    model_config = ConfigDict(extra="forbid")


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
    {"input_ids", optional "labels"} (seqpar.train.formats). Relative `path` and `chat_template` file
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
    size: int = Field(default=1, ge=1)
    ulysses_degree: int | None = Field(default=None, ge=1)
    ring_degree: int | None = Field(default=None, ge=1)
    layout: Literal["zigzag", "contiguous"] = "zigzag"

    @model_validator(mode="after")
    def _degrees(self) -> SequenceParallelSpec:
        u, r, s = self.ulysses_degree, self.ring_degree, self.size
        ok = ", ".join(str(d) for d in divisors(s))
        for name, val in (("ulysses_degree", u), ("ring_degree", r)):
            if val is not None and s % val != 0:
                raise ValueError(f"sequence_parallel.{name}={val} must divide size={s}: use one of {ok}")
        if u is not None and r is not None and u * r != s:
            raise ValueError(
                f"sequence_parallel: ulysses_degree={u} x ring_degree={r} = {u * r} != size={s}: "
                f"set size: {u * r}, or pick degrees whose product is {s}"
            )
        return self


class DPOSpec(_Strict):
    beta: float = Field(default=0.1, gt=0)
    loss_type: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"
    gamma: float = 0.5  # SimPO margin


class GRPOSpec(_Strict):
    """`stage: grpo` (docs/grpo.md). reward_funcs: "module:function" import paths (seqpar:<name> for the
    built-ins of seqpar.train.rewards); beta: KL coefficient (0: no reference model); epsilon /
    epsilon_high: the PPO clip range [1 - epsilon, 1 + epsilon_high] (epsilon_high None: epsilon)."""

    reward_funcs: list[str] = Field(min_length=1)
    reward_weights: list[float] | None = None
    num_generations: int = Field(default=4, ge=2)
    max_prompt_length: int = Field(default=256, ge=1)
    max_completion_length: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    beta: float = Field(default=0.0, ge=0)
    epsilon: float = Field(default=0.2, gt=0, lt=1)
    epsilon_high: float | None = Field(default=None, gt=0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo"] = "grpo"
    scale_rewards: Literal["group", "none"] = "group"
    num_iterations: int = Field(default=1, ge=1)
    # k3 KL x the differentiable importance ratio (TRL's use_bias_correction_kl; same value on-policy)
    kl_ratio_correction: bool = False

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_bool(cls, v: Any) -> Any:
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v  # TRL's old bool form

    @model_validator(mode="after")
    def _checks(self) -> GRPOSpec:
        if self.num_iterations != 1:
            raise ValueError(
                f"num_iterations={self.num_iterations}: only 1 is supported (one gradient step per generation, so "
                "the old policy is the current one): set num_iterations: 1"
            )
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
    name: Literal["adamw", "sgd"] = "adamw"
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


class MemorySpec(_Strict):
    """Long-context memory features (docs/memory.md). Each keeps the loss and gradients exact.

    activation_checkpointing: recompute each decoder layer in backward (non-reentrant); only layer
      inputs stay alive between forward and backward.
    offload_activations: with activation_checkpointing, keep those layer inputs in host memory
      (CUDA only; refused on CPU, where it would do nothing).
    fused_loss: lm_head + loss over chunks of tokens, so no [S_local, vocab] logits tensor exists.
    loss_chunk_tokens: tokens per loss chunk; None = as many as keep one chunk's fp32 logits <= 256 MB.
    tiled_mlp: run each decoder MLP over sequence tiles, recomputing tile by tile in backward;
      true = tile count from the shapes, an int = that many tiles.
    measure: exact per-rank peak of live tensor bytes per step (seqpar.memory.meter), logged as
      peak_alloc_mb (max over ranks); it costs Python work per op, so set false for timing runs.
    """

    activation_checkpointing: bool = False
    offload_activations: bool = False
    fused_loss: bool = True
    loss_chunk_tokens: int | None = Field(default=None, ge=1)
    tiled_mlp: bool | int = False
    measure: bool = True

    @field_validator("tiled_mlp")
    @classmethod
    def _tiles(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"memory.tiled_mlp={v}: use true (automatic tile count), false, or a tile count >= 1")
        return v

    @model_validator(mode="after")
    def _offload_needs_ckpt(self) -> MemorySpec:
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError(
                "memory.offload_activations offloads the checkpointed layer inputs: also set "
                "memory.activation_checkpointing: true"
            )
        return self


class FSDPSpec(_Strict):
    """`fsdp: true` or `fsdp: {enabled: true, offload: true}`; truthy when enabled.

    offload: parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy; CUDA only).
    """

    enabled: bool = False
    offload: bool = False

    def __bool__(self) -> bool:
        return self.enabled


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
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    micro_batch_size: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    # Exactly one of max_steps / num_epochs (neither: max_steps 10); see steps_for_epochs for the rule.
    max_steps: int | None = Field(default=None, ge=1)
    num_epochs: float | None = Field(default=None, gt=0)
    eval_dataset: DatasetSpec | None = None  # fields not given are taken from `dataset`
    eval_every: int = Field(default=0, ge=0)  # steps between evals; 0 = only after the last step
    report_to: list[Literal["tensorboard"]] = Field(default_factory=list)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    # A step whose global loss or gradient norm is NaN/inf updates nothing; this many in a row stop the run.
    max_consecutive_nonfinite: int = Field(default=3, ge=1)
    output_dir: str = "runs/seqpar"  # relative: to the config file when loaded from one, else to the cwd
    seed: int = 0
    progress: bool = True

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

    @model_validator(mode="after")
    def _cross(self) -> TrainConfig:
        if self.max_steps is not None and self.num_epochs is not None:
            raise ValueError("set max_steps or num_epochs, not both")
        if self.max_steps is None and self.num_epochs is None:
            self.max_steps = 10
        if self.stage == "dpo" and self.dataset.packing:
            raise ValueError(
                "dataset.packing is not supported with stage: dpo (pairs are padded rows): set packing: false"
            )
        if self.stage == "grpo" or self.grpo is not None:
            _check_grpo(self)
        if self.dataset.packing and self.micro_batch_size != 1:
            raise ValueError(
                "with dataset.packing, a micro-batch is one packed row of up to max_length tokens: "
                "set micro_batch_size: 1 (raise max_length or grad_accum for more tokens per step)"
            )
        return self


def _check_grpo(cfg: TrainConfig) -> None:
    """stage: grpo rules that involve more than the grpo: section (docs/grpo.md, "Refusals")."""
    g = cfg.grpo
    if cfg.stage != "grpo":
        raise ValueError(f"a grpo: section is only read with stage: grpo (stage is {cfg.stage!r}): remove it")
    if g is None:
        raise ValueError("stage: grpo needs a grpo: section with at least reward_funcs: [...] (docs/grpo.md)")
    rows = cfg.micro_batch_size * cfg.grad_accum
    if rows % g.num_generations:
        raise ValueError(
            f"grpo.num_generations={g.num_generations} must divide micro_batch_size x grad_accum = {rows} (the "
            f"completion rows per dp rank and step; a prompt's completions never split over dp ranks): e.g. set "
            f"grad_accum: {g.num_generations // math.gcd(g.num_generations, cfg.micro_batch_size)}"
        )
    if cfg.dataset.packing:
        raise ValueError("dataset.packing is not supported with stage: grpo (one advantage per row): "
                         "set packing: false")
    if cfg.fsdp:
        raise ValueError("fsdp is not supported with stage: grpo (generation runs on one rank per SP group, an "
                         "FSDP-sharded forward needs every rank): set fsdp: false")
    need = g.max_prompt_length + g.max_completion_length
    if cfg.dataset.max_length < need:
        raise ValueError(f"dataset.max_length={cfg.dataset.max_length} < grpo.max_prompt_length + "
                         f"max_completion_length = {need}: set max_length: {need} or more")
    if cfg.eval_dataset is not None:
        raise ValueError("eval_dataset is not supported with stage: grpo: remove it")
    if cfg.num_epochs is not None:
        raise ValueError("num_epochs is not supported with stage: grpo (steps are counted in prompts): set max_steps")


def config_from_dict(data: dict[str, Any], source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key: remove it or check its spelling (see docs/training.md)"
            elif err["type"] == "missing":
                msg = "required: add it"
            lines.append(f"  {loc}: {msg}")
        raise SeqParError(f"invalid {source}:\n" + "\n".join(lines)) from None


def load_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML config; `overrides` are dotted keys, e.g. {"max_steps": 5, "sequence_parallel.size": 2}."""
    p = Path(path)
    if not p.is_file():
        raise SeqParError(f"config file {str(p)!r} does not exist: pass the path to a YAML file")
    with open(p) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SeqParError(f"{p}: the top level must be a mapping of keys (model:, dataset:, ...)")
    _relative_to(data, p.parent)
    for key, val in (overrides or {}).items():
        set_dotted(data, key, val)
    for a, b in (("max_steps", "num_epochs"), ("num_epochs", "max_steps")):
        if a in (overrides or {}) and b not in (overrides or {}):
            data.pop(b, None)  # --max-steps on the command line replaces the file's num_epochs (and back)
    # Override values (CLI --set / --output-dir) keep the caller's working directory as their base, except
    # dataset paths, which fall back to the config directory as before.
    for name in ("dataset", "eval_dataset"):
        ds = data.get(name)
        if isinstance(ds, dict) and isinstance(ds.get("path"), str) and not os.path.isabs(ds["path"]):
            cand = p.parent / ds["path"]
            if cand.exists() and not Path(ds["path"]).exists():
                ds["path"] = str(cand)
    return config_from_dict(data, source=str(p))


def _relative_to(data: dict[str, Any], base: Path) -> None:
    """Relative paths written in a config file are relative to that file, so configs travel with their data:
    dataset/eval_dataset path (when it exists there) and chat_template file, and output_dir."""
    base = base.absolute()  # a config re-loaded from elsewhere (verify's copies) must not re-resolve them
    for name in ("dataset", "eval_dataset"):
        ds = data.get(name)
        if isinstance(ds, str):
            ds = data[name] = {"path": ds}
        if not isinstance(ds, dict):
            continue
        for key in ("path", "chat_template"):
            v = ds.get(key)
            if isinstance(v, str) and not os.path.isabs(v) and "{" not in v and (base / v).exists():
                ds[key] = str(base / v)
    out = data.get("output_dir")
    if isinstance(out, str) and not os.path.isabs(out):
        data["output_dir"] = str(base / out)


def set_dotted(data: dict[str, Any], key: str, val: Any) -> None:
    parts = key.split(".")
    cur = data
    for part in parts[:-1]:
        nxt = cur.get(part)
        if isinstance(nxt, int) and part == "sequence_parallel":
            nxt = {"size": nxt}
        if not isinstance(nxt, dict):
            nxt = {} if nxt is None else ({"name": nxt} if part == "model" else nxt)
        cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = val


def resolve_sp_degrees(sp: SequenceParallelSpec, num_heads: int | None, num_kv_heads: int | None, *,
                       ulysses_only: bool = False) -> tuple[int, int]:
    """(ulysses, ring) as seqpar.init_mesh will choose them (ulysses_only: models with linear attention)."""
    u, r = sp.ulysses_degree, sp.ring_degree
    if u is None and r is None:
        return auto_degrees(sp.size, num_heads, num_kv_heads, ulysses_only=ulysses_only)
    if u is None:
        return sp.size // r, r
    if r is None:
        return u, sp.size // u
    return u, r


def validate_for_launch(cfg: TrainConfig, world_size: int, *, num_heads: int | None = None,
                        num_kv_heads: int | None = None, ulysses_only: bool = False) -> tuple[int, int]:
    """Checks that need the world size and head counts; returns (ulysses, ring). No collectives."""
    sp = cfg.sequence_parallel.size
    if world_size % sp != 0:
        ok = ", ".join(str(d) for d in divisors(world_size))
        raise SeqParError(
            f"sequence_parallel.size={sp} does not divide the world size {world_size}: set size to one of "
            f"{ok}, or launch a multiple of {sp} processes (--nproc-per-node)"
        )
    u, r = resolve_sp_degrees(cfg.sequence_parallel, num_heads, num_kv_heads, ulysses_only=ulysses_only)
    m = required_multiple(r, u, cfg.sequence_parallel.layout if r > 1 else "contiguous")
    for name, ds in (("dataset", cfg.dataset), ("eval_dataset", cfg.eval_dataset)):
        L = ds.max_length if ds is not None else m
        if L % m != 0:
            lo, hi = (L // m) * m, (L // m + 1) * m
            alts = " or ".join(str(x) for x in (lo, hi) if x > 0)
            raise SeqParError(
                f"{name}.max_length={L} cannot be split evenly over sequence_parallel.size={sp} "
                f"(ulysses={u}, ring={r}, layout={cfg.sequence_parallel.layout}): it must be a multiple of {m}; "
                f"use max_length: {alts}"
            )
    if "tensorboard" in cfg.report_to:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise SeqParError(
                "report_to: tensorboard needs the tensorboard package: pip install tensorboard (or drop report_to)"
            ) from None
    return u, r


def steps_for_epochs(cfg: TrainConfig, n_examples: int, dp_size: int) -> int:
    """Optimizer steps for cfg.num_epochs passes over n_examples (rows, or packs when packing).

    steps = ceil(num_epochs x ceil(n_examples / dp_size) / (micro_batch_size x grad_accum)): each dp slot
    sees ceil(n / dp) rows per epoch (the sampler wraps around to even out dp slots) and a step takes
    micro_batch_size x grad_accum of them (a pack counts as one row).
    """
    per_slot = math.ceil(n_examples / dp_size)
    return max(1, math.ceil(cfg.num_epochs * per_slot / (cfg.micro_batch_size * cfg.grad_accum)))


def with_total_steps(cfg: TrainConfig, n_examples: int, dp_size: int) -> TrainConfig:
    """cfg with max_steps filled in from num_epochs (unchanged when max_steps was given)."""
    if cfg.num_epochs is None:
        return cfg
    return cfg.model_copy(update={"max_steps": steps_for_epochs(cfg, n_examples, dp_size)})
