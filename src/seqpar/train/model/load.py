"""Loading the model and its tokenizer from `cfg.model`: a tiny random model (`tiny:<arch>`, seeded), the
bundled SmolLM2-135M-Instruct (`smollm2`), or a local Hugging Face directory / cached hub id. The config
alone (no weights) answers what the checks before launch need: head counts, linear attention, VLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import SeqParError
from ...hf.vision import is_vlm
from ...mesh import RecurrentHeads, recurrent_heads
from ..config import TrainConfig
from .tokenizers import ByteTokenizer, HFTokenizer, load_chat_template

__all__ = ["model_kind", "model_config", "ModelInfo", "model_info", "model_heads", "model_recurrent_heads",
           "load_tokenizer", "load_model", "loaded_heads", "apply_lora", "lora_targets", "tiny_kwargs"]


def model_kind(cfg: TrainConfig) -> str:
    name = cfg.model.name
    if name.startswith("tiny:"):
        from ...hf import TINY_ARCHS

        arch = name.split(":", 1)[1]
        if arch not in TINY_ARCHS:
            raise SeqParError(f"model.name={name!r}: unknown tiny architecture {arch!r}: use "
                              f"tiny:<{'|'.join(TINY_ARCHS)}>")
        return "tiny"
    if name.lower() in SMOLLM2_NAMES:
        return "smollm2"
    if _looks_like_path(name) and not os.path.isdir(os.path.expanduser(name)):
        raise SeqParError(f"model.name={name!r}: no such directory: point it at a local model folder (config.json "
                          f"and weights), or use a hub id, 'smollm2' or 'tiny:<arch>'")
    return "hf"


def _looks_like_path(name: str) -> bool:
    """A name no hub id can be ("org/name" is one): absolute, ./ ../ ~ prefixed, or with several '/'."""
    return os.path.isabs(name) or name.startswith(("./", "../", "~", ".\\")) or name.count("/") > 1


SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")


SMOLLM2_HEADS = (9, 3)  # SmolLM2-135M: 9 query heads, 3 kv heads


def unknown_model(name: str, e: Exception) -> SeqParError:
    return SeqParError(
        f"model.name={name!r} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:160]}): use a "
        f"local model directory, a cached hub id, 'smollm2' (bundled SmolLM2-135M-Instruct) or 'tiny:<arch>'"
    )


def tiny_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    kwargs = dict(cfg.model.kwargs)
    if not isinstance(kwargs.get("seed", 0), int) or isinstance(kwargs.get("seed"), bool):
        raise SeqParError(f"model.kwargs.seed={kwargs['seed']!r}: give an integer (or drop it: the run's seed)")
    if kwargs.get("dtype", "float32") not in TINY_DTYPES:
        raise SeqParError(f"model.kwargs.dtype={kwargs['dtype']!r}: use one of {', '.join(TINY_DTYPES)} (or drop it)")
    kwargs.setdefault("vocab_size", ByteTokenizer.vocab_size)
    if not isinstance(kwargs["vocab_size"], int) or kwargs["vocab_size"] < ByteTokenizer.vocab_size:
        raise SeqParError(
            f"tiny models use a byte tokenizer of {ByteTokenizer.vocab_size} ids: set model.kwargs.vocab_size >= "
            f"{ByteTokenizer.vocab_size}"
        )
    return kwargs


TINY_DTYPES = ("float32", "float64", "bfloat16", "float16")


def model_config(cfg: TrainConfig) -> Any:
    """The model's HF config alone (no weights loaded); None for the bundled SmolLM2."""
    kind = model_kind(cfg)
    if kind == "tiny":
        from ...hf import tiny_config

        arch = cfg.model.name.split(":", 1)[1]
        kw = {k: v for k, v in tiny_kwargs(cfg).items() if k not in ("seed", "dtype", "attn_implementation")}
        try:
            return tiny_config(arch, **kw)
        except SeqParError as e:  # a key the config class does not have (model_kind checked the arch)
            raise SeqParError(f"model.kwargs: {e}") from None
        except Exception as e:  # whatever transformers' config class says of the values: an input error
            raise SeqParError(f"model.kwargs {dict(cfg.model.kwargs)} do not make a tiny {arch} config "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:120]}): give positive integers "
                              "(num_heads, num_kv_heads dividing it, num_layers, head_dim, ...) or drop the key"
                              ) from None
    if kind == "smollm2":
        return None
    from transformers import AutoConfig

    # model.kwargs as load_model passes them to from_pretrained, which builds the config the same way: keys
    # naming config attributes (max_position_embeddings, rope_scaling, ...) override config.json, hub keys
    # (revision, trust_remote_code, ...) choose what is read, the rest is for the model (ignored here).
    kw = {k: v for k, v in cfg.model.kwargs.items() if k not in _MODEL_ONLY_KWARGS}
    try:
        return AutoConfig.from_pretrained(cfg.model.name, return_unused_kwargs=True, **kw)[0]
    except (OSError, ValueError) as e:
        raise unknown_model(cfg.model.name, e) from None


# from_pretrained keeps these out of the config (dtype "auto", a quantization config of its own).
_MODEL_ONLY_KWARGS = ("dtype", "torch_dtype", "quantization_config")


@dataclass(frozen=True)
class ModelInfo:
    """The model's config alone, read once per run (`model_info`: for a hub model one AutoConfig.from_pretrained)
    and passed to every check and builder that needs it. config: the HF config; None for the bundled SmolLM2
    (its facts are constants here)."""

    config: Any

    @property
    def vlm(self) -> bool:
        return is_vlm(self.config)

    @property
    def text_config(self) -> Any:
        """The decoder's config (a vision-language model's text_config); None for SmolLM2."""
        return self.config.text_config if self.vlm else self.config

    @property
    def heads(self) -> tuple[int, int]:
        """(num_heads, num_kv_heads) of the decoder."""
        c = self.text_config
        if c is None:
            return SMOLLM2_HEADS
        h = int(c.num_attention_heads)
        return h, int(getattr(c, "num_key_value_heads", None) or h)

    @property
    def recurrent(self) -> RecurrentHeads | None:
        """A hybrid model's recurrent-layer heads (Gated DeltaNet, Mamba2), which bound the Ulysses degree."""
        return recurrent_heads(self.config) if self.config is not None else None


def model_info(cfg: TrainConfig) -> ModelInfo:
    return ModelInfo(model_config(cfg))


def model_heads(cfg: TrainConfig, info: ModelInfo | None = None) -> tuple[int | None, int | None]:
    """(num_heads, num_kv_heads) from the model's config alone (no weights loaded)."""
    return (info or model_info(cfg)).heads


def model_recurrent_heads(cfg: TrainConfig, info: ModelInfo | None = None) -> RecurrentHeads | None:
    """A hybrid model's recurrent-layer heads (Gated DeltaNet, Mamba2), which bound the Ulysses degree."""
    return (info or model_info(cfg)).recurrent


def load_tokenizer(cfg: TrainConfig) -> Any:
    kind = model_kind(cfg)
    template = cfg.dataset.chat_template
    if kind == "tiny":
        if template is not None:
            raise SeqParError("dataset.chat_template needs an HF tokenizer; tiny models use a byte tokenizer: drop it")
        return ByteTokenizer()
    template = load_chat_template(template) if template is not None else None
    if kind == "smollm2":
        from ...hf import load_smollm2_tokenizer

        return HFTokenizer(load_smollm2_tokenizer(), template)
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name), template)
    except (OSError, ValueError) as e:
        raise unknown_model(cfg.model.tokenizer or cfg.model.name, e) from None


def load_model(cfg: TrainConfig, info: ModelInfo | None = None) -> torch.nn.Module:
    """The model in fp32 (see _run for bf16). Tiny models are seeded by cfg.seed."""
    kind = model_kind(cfg)
    if kind == "tiny":
        from ...hf import tiny_model

        kwargs = tiny_kwargs(cfg)
        kwargs.setdefault("seed", cfg.seed)
        if "dtype" in kwargs:
            kwargs["dtype"] = getattr(torch, kwargs["dtype"])
        try:
            return tiny_model(cfg.model.name.split(":", 1)[1], **kwargs)
        except ValueError as e:  # e.g. an attn_implementation transformers does not have
            raise SeqParError(f"model.kwargs {dict(cfg.model.kwargs)}: the tiny model cannot be built "
                              f"({str(e).splitlines()[0][:160]})") from None
    if kind == "smollm2":
        from ...hf import load_smollm2

        return load_smollm2(**cfg.model.kwargs)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if (info or model_info(cfg)).vlm else AutoModelForCausalLM
    try:
        return auto.from_pretrained(cfg.model.name, dtype=torch.float32, **cfg.model.kwargs)
    except (OSError, ValueError) as e:
        raise unknown_model(cfg.model.name, e) from None


def loaded_heads(model: torch.nn.Module) -> tuple[int, int]:
    c = model.config.text_config if is_vlm(model.config) else model.config
    h = int(c.num_attention_heads)
    return h, int(getattr(c, "num_key_value_heads", None) or h)


# Mamba1's mixer projections: LoRA's targets on a model without attention (Mamba, Falcon-Mamba) left at the default
MIXER_LORA_TARGETS = ("in_proj", "x_proj")  # (PEFT refuses out_proj and conv1d on Mamba; dt_proj is used by weight)


def lora_targets(model: torch.nn.Module, cfg: TrainConfig) -> list[str] | str:
    """cfg.finetuning.targets; at the default, on a model with none of attention's projections (Mamba,
    Falcon-Mamba: no attention at all), its recurrent mixers' projections instead (a line says so)."""
    targets = cfg.finetuning.targets
    if targets != type(cfg.finetuning).model_fields["targets"].get_default(call_default_factory=True):
        return targets
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    mixer = [t for t in MIXER_LORA_TARGETS if t in names]
    if names & set(targets) or not mixer:
        return targets  # (no match at all: PEFT's error names the targets)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"[seqpar] finetuning.targets: {type(model).__name__} has no attention projections "
              f"({', '.join(targets)}, the default): LoRA on its mixers' {', '.join(mixer)} (set finetuning.targets "
              f"to choose others)", flush=True)
    return mixer


def apply_lora(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """The PEFT LoRA wrapper of cfg.finetuning (seed it first: the adapter's A init is random)."""
    from peft import LoraConfig, get_peft_model

    f = cfg.finetuning
    return get_peft_model(model, LoraConfig(r=f.r, lora_alpha=f.alpha, lora_dropout=f.dropout,
                                            target_modules=lora_targets(model, cfg), bias="none"))
