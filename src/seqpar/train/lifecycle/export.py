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

`seqpar export CKPT OUT` writes only where it cannot destroy anything (`check_export_destination`): OUT must not
be, or sit inside, a run's output_dir or a checkpoint (`--overwrite` does not lift that); an existing OUT must be
empty, or an earlier export (its seqpar_export.json lists every file it wrote) holding nothing else, which only
`--overwrite` replaces. The export is written into a fresh hidden folder next to OUT and then moved into place.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...errors import SeqParError
from ...textfiles import read_json
from ..config import TrainConfig, config_from_dict
from ..model.load import apply_lora, load_model, load_tokenizer, model_kind
from ..model.tokenizers import ByteTokenizer
from .checkpoint import checkpoint_step, first_failure, full_model_state
from .output_dir import in_run_message, runs_around

__all__ = ["export_trained", "export_checkpoint", "build_clean_model", "load_exported_tokenizer",
           "checkpoint_config", "check_export_destination", "EXPORT_INFO"]

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"
EXPORT_INFO = "seqpar_export.json"  # what was exported, and every file the export wrote ("files")
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


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())


def check_export_destination(out: Path, overwrite: bool) -> None:
    """SeqParError unless `seqpar export` may write `out` (module docstring): never into a run, never over files
    an export did not write, an earlier export only with --overwrite."""
    runs = runs_around(out)
    if runs:
        where, instead = in_run_message(out, runs)
        raise SeqParError(f"export destination {where}: an export never writes into a run or a checkpoint (it would "
                          f"replace the run's files), with or without --overwrite: choose a folder outside the run, "
                          f"e.g. {instead}")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        kind = "a symbolic link" if out.is_symlink() else "a file"
        raise SeqParError(f"export destination {out} is {kind}, not a folder: choose a new folder name")
    if not out.is_dir() or not any(out.iterdir()):
        return
    info = _export_info(out)
    if info is None:
        names = sorted(p.name for p in out.iterdir())
        raise SeqParError(f"export destination {out} already holds files that `seqpar export` did not write "
                          f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): choose a new folder (or an "
                          f"empty one); an export never deletes what it did not write")
    if not overwrite:
        raise SeqParError(f"export destination {out} already holds an export (of {info.get('source')}, step "
                          f"{info.get('step')}): pass --overwrite to replace it, or choose a new folder")
    if not isinstance(info.get("files"), list):
        raise SeqParError(f"export destination {out} holds an export whose {EXPORT_INFO} does not list the files it "
                          f"wrote (an older seqpar): remove the folder yourself, or choose a new folder")
    extra = sorted(set(_files(out)) - set(info["files"]))
    if extra:
        raise SeqParError(f"export destination {out} holds an earlier export and files it did not write "
                          f"({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}): move them away or choose a "
                          f"new folder (--overwrite replaces only what the earlier export wrote)")


def _export_info(out: Path) -> dict[str, Any] | None:
    """The seqpar_export.json of an earlier export in `out` (None: not an export, or unreadable)."""
    try:
        info = json.loads((out / EXPORT_INFO).read_bytes())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _write(model: torch.nn.Module, cfg: TrainConfig, tok: Any, out: Path, merge_lora: bool, step: int | None,
           source: str) -> Path:
    """Write the export into a fresh hidden folder next to `out` (removed again if writing fails), then move it
    into place; an existing `out` (checked by the caller) is replaced."""
    if merge_lora and cfg.finetuning.method != "lora":
        raise SeqParError("--merge-lora / export.merged_lora is for LoRA runs: this run is full fine-tuning")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))  # a new name: nothing else touched
    try:
        info = _write_files(model, cfg, tok, tmp, merge_lora, step, source)
        info["files"] = sorted([*_files(tmp), EXPORT_INFO])
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.is_dir():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _write_files(model: torch.nn.Module, cfg: TrainConfig, tok: Any, tmp: Path, merge_lora: bool, step: int | None,
                 source: str) -> dict[str, Any]:
    """The model / adapter (+ base, merged) and tokenizer files into `tmp`; returns the export's info."""
    lora = cfg.finetuning.method == "lora"
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
    return info


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
        meta = read_json(run, "checkpoint record")
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
            raise SeqParError(f"checkpoint record {run} has no config: it is damaged; export another checkpoint")
        return config_from_dict(meta["config"], source=str(run))
    cfg_path = ckpt.parent / "config.json"
    if cfg_path.is_file():
        return config_from_dict(read_json(cfg_path, "run config"), source=str(cfg_path))
    raise SeqParError(f"{ckpt} has no run.json and {cfg_path} does not exist: export needs the run's config "
                      f"(the output_dir that `seqpar train` wrote, with its checkpoint-N folders)")


def export_checkpoint(ckpt: str | Path, out: str | Path, *, merge_lora: bool = False, overwrite: bool = False) -> Path:
    """Export a saved checkpoint-N folder (one process, no process group) like the end of `seqpar train`.
    `out`: see `check_export_destination` (checked before anything is loaded)."""
    import torch.distributed.checkpoint as dcp

    ckpt = Path(ckpt)
    if not (ckpt / ".metadata").is_file():
        raise SeqParError(f"{ckpt} is not a checkpoint folder (no .metadata): pass <output_dir>/checkpoint-<step>")
    check_export_destination(Path(out), overwrite)
    cfg = checkpoint_config(ckpt)
    lora = cfg.finetuning.method == "lora"
    clean = build_clean_model(cfg)
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    trainable = {n for n, p in clean.named_parameters() if p.requires_grad}
    want = {k: v for k, v in clean.state_dict().items()
            if f"model.{k}" in saved and (not lora or k in trainable)}
    try:
        dcp.load({"model": want}, checkpoint_id=str(ckpt))
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP's exception is a BaseException
        raise SeqParError(f"checkpoint {ckpt} cannot be read ({type(first_failure(e)).__name__}: "
                          f"{(str(first_failure(e)).splitlines() or [''])[0][:200]}): it is damaged; export "
                          f"another checkpoint of the run") from None
    _load_state(clean, want, lora, str(ckpt))
    step = checkpoint_step(ckpt)
    return _write(clean, cfg, load_tokenizer(cfg), Path(out), merge_lora, step, str(ckpt))
