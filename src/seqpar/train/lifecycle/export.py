"""Hugging Face exports of a trained model: <output_dir>/final/ after `seqpar train`, `seqpar export`.

    final/                 full fine-tuning: config.json + model.safetensors (save_pretrained)
                           LoRA: adapter_config.json + adapter_model.safetensors (PEFT, adapter only)
    final/merged/          LoRA with export.merged_lora / --merge-lora: base + adapter merged
    final/base/            LoRA on a tiny:<arch> model: the (frozen, seeded) base the adapter belongs to
    final/<tokenizer files> or final/byte_tokenizer.json (tiny models: `load_exported_tokenizer`)
    final/seqpar_export.json  what was exported, from which step, and how to load it

The weights are written from a CLEAN copy of the model (`load_model(cfg)`, + the same LoRA wrapper),
loaded with the trained state: its config never names seqpar's attention (the SP model's own config
copy says `seqpar_sp_N`) and has no hooks. Under FSDP2 the full state dict is gathered to rank 0
(`get_model_state_dict(full_state_dict=True, cpu_offload=True)`): every rank must call `export_trained`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...errors import SeqParError
from ..config import TrainConfig, config_from_dict
from ..model.load import apply_lora, load_model, load_tokenizer, model_kind
from ..model.tokenizers import ByteTokenizer
from .checkpoint import checkpoint_step, full_model_state

__all__ = ["export_trained", "export_checkpoint", "build_clean_model", "load_exported_tokenizer",
           "checkpoint_config"]

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def build_clean_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model as `seqpar train` builds it, without SP attention or FSDP (LoRA: the PEFT wrapper)."""
    model = load_model(cfg)
    return apply_lora(model, cfg) if cfg.finetuning.method == "lora" else model


def _shared_storage_names(model: torch.nn.Module) -> set[str]:
    """Parameter names whose storage another name also uses (tied weights: one of them may be absent)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        ptr = t.data_ptr()
        if ptr in seen:
            tied.update({name, seen[ptr]})
        seen.setdefault(ptr, name)
    return tied


def _load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], lora: bool, source: str) -> None:
    """Load the trained weights; LoRA: exactly the trainable ones must be there, full: all but tied copies."""
    floats = [v for v in state.values() if torch.is_floating_point(v)]
    if floats:
        model.to(floats[0].dtype)  # export in the dtype that was trained (bf16 without FSDP stays bf16)
    res = model.load_state_dict(state, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if lora:
        bad_missing = sorted(set(res.missing_keys) & trainable)
    else:
        bad_missing = sorted(set(res.missing_keys) - _shared_storage_names(model))
    if bad_missing or res.unexpected_keys:
        raise SeqParError(
            f"{source} does not match the model of its config (missing {bad_missing[:3]}, unexpected "
            f"{list(res.unexpected_keys)[:3]}): export with the config that trained it"
        )


def _save_tokenizer(tok: Any, out: Path) -> str:
    if isinstance(tok, ByteTokenizer):
        (out / BYTE_TOKENIZER_FILE).write_text(json.dumps({
            "type": "seqpar.train.model.tokenizers.ByteTokenizer", "vocab_size": tok.vocab_size,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "note": "UTF-8 bytes are ids 0..255; load with seqpar.train.lifecycle.export.load_exported_tokenizer(dir)",
        }, indent=2))
        return "byte"
    tok.tok.save_pretrained(str(out))
    return "hf"


def load_exported_tokenizer(path: str | Path) -> Any:
    """The tokenizer of an export: a transformers tokenizer, or seqpar's ByteTokenizer (tiny models)."""
    p = Path(path)
    if (p / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def _write(model: torch.nn.Module, cfg: TrainConfig, tok: Any, out: Path, merge_lora: bool, step: int | None,
           source: str) -> Path:
    """Write the export into a fresh folder next to `out`, then move it into place."""
    lora = cfg.finetuning.method == "lora"
    if merge_lora and not lora:
        raise SeqParError("--merge-lora / export.merged_lora is for LoRA runs: this run is full fine-tuning")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    info: dict[str, Any] = {"source": source, "step": step, "model": cfg.model.name, "method": cfg.finetuning.method}
    if lora:
        if cfg.model.name.startswith("tiny:"):
            # A random tiny base exists nowhere else: write it so PeftModel.from_pretrained(base, dir) can load.
            load_model(cfg).save_pretrained(str(tmp / "base"))  # the frozen base: untouched by LoRA training
            info["base"] = "base/ (AutoModelForCausalLM.from_pretrained(final/base))"
        elif model_kind(cfg) == "smollm2":
            info["base"] = (f"{SMOLLM2_HUB_ID} (trained on its Q4_1 GGUF, dequantized: seqpar.hf.load_smollm2() "
                            "gives that exact base)")
        else:
            info["base"] = cfg.model.name
            model.peft_config["default"].base_model_name_or_path = cfg.model.name
        model.save_pretrained(str(tmp))
        if model_kind(cfg) == "smollm2":
            # The adapter config must not point into this machine's seqpar cache: name the hub model (written
            # after saving, so PEFT does not look the hub up while saving; training used its dequantized GGUF).
            conf = tmp / "adapter_config.json"
            conf.write_text(json.dumps({**json.loads(conf.read_text()), "base_model_name_or_path": SMOLLM2_HUB_ID},
                                       indent=2))
        if merge_lora:
            import copy

            copy.deepcopy(model).merge_and_unload().save_pretrained(str(tmp / "merged"))
            info["merged"] = "merged/"
    else:
        model.save_pretrained(str(tmp))
    info["tokenizer"] = _save_tokenizer(tok, tmp)
    (tmp / "seqpar_export.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def export_trained(model: torch.nn.Module, cfg: TrainConfig, tok: Any, out: str | Path, *, merge_lora: bool = False,
                   step: int | None = None) -> Path | None:
    """Export the (SP / LoRA / FSDP2) model being trained. A collective under FSDP: call on every rank;
    rank 0 writes and gets the path, the others get None."""
    lora = cfg.finetuning.method == "lora"
    state = full_model_state(model, trainable_only=lora)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = None
    if rank == 0:
        clean = build_clean_model(cfg)
        _load_state(clean, state, lora, "the trained model")
        path = _write(clean, cfg, tok, Path(out), merge_lora, step, "seqpar train")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return path


def checkpoint_config(ckpt: str | Path) -> TrainConfig:
    """The config of the run that wrote a checkpoint: checkpoint-N/run.json, else <output_dir>/config.json."""
    ckpt = Path(ckpt)
    run = ckpt / "run.json"
    if run.is_file():
        return config_from_dict(json.loads(run.read_text())["config"], source=str(run))
    cfg_path = ckpt.parent / "config.json"
    if cfg_path.is_file():
        return config_from_dict(json.loads(cfg_path.read_text()), source=str(cfg_path))
    raise SeqParError(f"{ckpt} has no run.json and {cfg_path} does not exist: export needs the run's config "
                      f"(the output_dir that `seqpar train` wrote, with its checkpoint-N folders)")


def export_checkpoint(ckpt: str | Path, out: str | Path, *, merge_lora: bool = False) -> Path:
    """Export a saved checkpoint-N folder (one process, no process group) like the end of `seqpar train`."""
    import torch.distributed.checkpoint as dcp

    ckpt = Path(ckpt)
    if not (ckpt / ".metadata").is_file():
        raise SeqParError(f"{ckpt} is not a checkpoint folder (no .metadata): pass <output_dir>/checkpoint-<step>")
    cfg = checkpoint_config(ckpt)
    lora = cfg.finetuning.method == "lora"
    clean = build_clean_model(cfg)
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    trainable = {n for n, p in clean.named_parameters() if p.requires_grad}
    want = {k: v for k, v in clean.state_dict().items()
            if f"model.{k}" in saved and (not lora or k in trainable)}
    dcp.load({"model": want}, checkpoint_id=str(ckpt))
    _load_state(clean, want, lora, str(ckpt))
    step = checkpoint_step(ckpt)
    return _write(clean, cfg, load_tokenizer(cfg), Path(out), merge_lora, step, str(ckpt))
