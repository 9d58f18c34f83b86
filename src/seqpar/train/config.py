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

    format: auto (from the fields), text {"text"}, instruction {"instruction"|"prompt", "response"|
    "completion"}, chat {"messages": [{"role", "content"}]}, dpo {"prompt", "chosen", "rejected"},
    tokenized {"input_ids", optional "labels"}.
    """

    path: str
    format: Literal["auto", "text", "instruction", "chat", "dpo", "tokenized"] = "auto"
    max_length: int = Field(gt=0)
    packing: bool = False
    shuffle: bool = True


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


class FinetuningSpec(_Strict):
    method: Literal["full", "lora"] = "full"
    r: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class OptimizerSpec(_Strict):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = Field(default=None, gt=0)


class ScheduleSpec(_Strict):
    name: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)


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
    """

    activation_checkpointing: bool = False
    offload_activations: bool = False
    fused_loss: bool = True
    loss_chunk_tokens: int | None = Field(default=None, ge=1)
    tiled_mlp: bool | int = False

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
    stage: Literal["sft", "dpo"] = "sft"
    dpo: DPOSpec = Field(default_factory=DPOSpec)
    finetuning: FinetuningSpec = Field(default_factory=FinetuningSpec)
    sequence_parallel: SequenceParallelSpec = Field(default_factory=SequenceParallelSpec)
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    precision: Literal["fp32", "bf16"] = "fp32"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    micro_batch_size: int = Field(default=1, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    max_steps: int = Field(default=10, ge=1)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    # A step whose global loss or gradient norm is NaN/inf updates nothing; this many in a row stop the run.
    max_consecutive_nonfinite: int = Field(default=3, ge=1)
    output_dir: str = "runs/seqpar"
    seed: int = 0
    progress: bool = True

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
        if self.stage == "dpo" and self.dataset.packing:
            raise ValueError(
                "dataset.packing is not supported with stage: dpo (pairs are padded rows): set packing: false"
            )
        if self.dataset.packing and self.micro_batch_size != 1:
            raise ValueError(
                "with dataset.packing, a micro-batch is one packed row of up to max_length tokens: "
                "set micro_batch_size: 1 (raise max_length or grad_accum for more tokens per step)"
            )
        return self


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
    for key, val in (overrides or {}).items():
        set_dotted(data, key, val)
    # Relative dataset paths are relative to the config file, so configs travel with their data.
    ds = data.get("dataset")
    if isinstance(ds, dict) and isinstance(ds.get("path"), str) and not os.path.isabs(ds["path"]):
        cand = p.parent / ds["path"]
        if cand.exists() and not Path(ds["path"]).exists():
            ds["path"] = str(cand)
    return config_from_dict(data, source=str(p))


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


def resolve_sp_degrees(sp: SequenceParallelSpec, num_heads: int | None, num_kv_heads: int | None) -> tuple[int, int]:
    """(ulysses, ring) as seqpar.init_mesh will choose them."""
    u, r = sp.ulysses_degree, sp.ring_degree
    if u is None and r is None:
        return auto_degrees(sp.size, num_heads, num_kv_heads)
    if u is None:
        return sp.size // r, r
    if r is None:
        return u, sp.size // u
    return u, r


def validate_for_launch(cfg: TrainConfig, world_size: int, *, num_heads: int | None = None,
                        num_kv_heads: int | None = None) -> tuple[int, int]:
    """Checks that need the world size and head counts; returns (ulysses, ring). No collectives."""
    sp = cfg.sequence_parallel.size
    if world_size % sp != 0:
        ok = ", ".join(str(d) for d in divisors(world_size))
        raise SeqParError(
            f"sequence_parallel.size={sp} does not divide the world size {world_size}: set size to one of "
            f"{ok}, or launch a multiple of {sp} processes (--nproc-per-node)"
        )
    u, r = resolve_sp_degrees(cfg.sequence_parallel, num_heads, num_kv_heads)
    m = required_multiple(r, u, cfg.sequence_parallel.layout if r > 1 else "contiguous")
    L = cfg.dataset.max_length
    if L % m != 0:
        lo, hi = (L // m) * m, (L // m + 1) * m
        alts = " or ".join(str(x) for x in (lo, hi) if x > 0)
        raise SeqParError(
            f"dataset.max_length={L} cannot be split evenly over sequence_parallel.size={sp} "
            f"(ulysses={u}, ring={r}, layout={cfg.sequence_parallel.layout}): it must be a multiple of {m}; "
            f"use max_length: {alts}"
        )
    return u, r
