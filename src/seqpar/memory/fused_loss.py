"""Fused chunked lm_head + loss: the per-token NLL without any [S_local, vocab] logits tensor.

    with fused_targets(model, batch["shift_labels"]) as req:
        out = model(input_ids=..., position_ids=...)
    nll = req.result(out)          # [B, S_local] fp32, 0 where not supervised

RL (seqpar.rl): `fused_targets(..., temperature=T, entropy=True)` also scales the logits by 1/T and
fills `req.entropy_result(out)`, the per-token entropy; the same chunked algorithm
(`seqpar.loss.chunked_token_stats`) computes both.

How: the model's output-embedding module (`get_output_embeddings()`, usually `lm_head`) gets an
instance-level `forward` override, installed once per model (no module is replaced, so state_dict
keys, FSDP2 sharding and PEFT adapters are untouched). Without a pending request it calls the
original forward. With one, it computes the NLL from the hidden states in checkpointed chunks of
supervised tokens (`seqpar.loss.chunked_token_nll`), applying the model's post-lm_head logit
transform inside each chunk, stores it in the request, and returns an empty `[B, S_local, 0]`
tensor, on which the model's own post-processing (softcap, scaling) is a no-op.

Why inside the model's forward rather than calling the decoder body + head by hand: FSDP2 unshards
the root module's parameters (lm_head, tied embeddings) in the root's forward hooks and relies on
the hooks on its outputs in backward; calling the body directly would bypass them. It also keeps
every wrapper (DDP, PEFT, accelerate) in the call path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .. import loss as L
from ..errors import SeqParError
from ..unwrap import base_model

__all__ = ["FusedRequest", "fused_targets", "install_fused_head", "default_chunk_tokens", "FUSED_OFF_HINT"]

FUSED_OFF_HINT = "set `memory.fused_loss: false` (seqpar train) or fused_loss=False (SequenceParallelTrainer)"
_STATE = "_seqpar_fused_head"
_CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits


@dataclass
class FusedRequest:
    """One forward's targets; the head fills `nll` ([B, S_local] fp32) during model(**inputs), and
    `entropy` when `want_entropy` (both of the softmax of logits / temperature)."""

    shift_labels: torch.Tensor
    chunk_tokens: int
    ignore_index: int = L.IGNORE_INDEX
    nll: torch.Tensor | None = None
    temperature: float = 1.0
    want_entropy: bool = False
    entropy: torch.Tensor | None = None
    # A dict to fill with the detached per-token seqpar.loss.TOKEN_METRICS (logging), or None.
    metrics: dict[str, torch.Tensor] | None = None

    def result(self, output: Any) -> torch.Tensor:
        """The NLL, tied to the model's (empty) logits output so wrappers' output hooks see the loss."""
        logits = output.logits if hasattr(output, "logits") else output[0]
        if self.nll is None or logits.shape[-1] != 0:
            raise SeqParError(
                "the fused loss head was not used by this model's forward (it computes logits without calling "
                f"get_output_embeddings(), or post-processes them in a way seqpar cannot fuse): {FUSED_OFF_HINT}"
            )
        # Sum of an empty tensor: an exact 0 that puts the returned logits (and the hooks wrappers put on
        # the model's outputs, e.g. FSDP2's pre-backward) on the loss's autograd path.
        return self.nll + logits.sum().to(self.nll.dtype)

    def entropy_result(self, output: Any) -> torch.Tensor:
        """The per-token entropy [B, S_local] (request made with entropy=True), tied to the output like `result`."""
        self.result(output)  # the same checks
        if self.entropy is None:
            raise SeqParError("fused_targets(..., entropy=True) is needed to read the per-token entropy")
        return self.entropy + _output_logits_sum(output, self.entropy.dtype)


def _output_logits_sum(output: Any, dtype: torch.dtype) -> torch.Tensor:
    """Sum of the model's (empty) logits output: an exact 0 on the autograd path of its output hooks."""
    logits = output.logits if hasattr(output, "logits") else output[0]
    return logits.sum().to(dtype)


class _FusedHead:
    """Per-head state: the original forward, the logit transform, and the pending request (if any)."""

    def __init__(self, orig_forward: Callable, transform: Callable | None) -> None:
        self.orig_forward = orig_forward
        self.transform = transform
        self.request: FusedRequest | None = None


def _fused_forward(self: torch.nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    state: _FusedHead = self.__dict__[_STATE]
    req = state.request
    if req is None:
        return state.orig_forward(hidden, *args, **kwargs)
    if req.nll is not None:
        raise SeqParError(f"the model called its output embeddings twice in one forward: {FUSED_OFF_HINT}")
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(req.shift_labels.shape):
        raise SeqParError(
            f"fused loss: lm_head got hidden states {tuple(hidden.shape)} but shift_labels are "
            f"{tuple(req.shift_labels.shape)} (logits_to_keep must stay 0): {FUSED_OFF_HINT}"
        )
    def head(h: torch.Tensor) -> torch.Tensor:
        return state.orig_forward(h, *args, **kwargs)

    req.nll, req.entropy = L.chunked_token_stats(
        hidden, req.shift_labels, head, req.chunk_tokens, req.ignore_index, state.transform,
        temperature=req.temperature, entropy=req.want_entropy, metrics=req.metrics,
    )
    # Empty, but computed FROM the NLL: wrappers that walk the autograd graph of the model's outputs
    # (DDP find_unused_parameters=True, the HF Trainer's default) then see lm_head's parameters as used.
    # clone(): not a view (FSDP2 warns on view outputs).
    return req.nll.unsqueeze(-1)[..., :0].to(hidden.dtype).clone()


# ----------------------------------------------------------------------------- post-lm_head transforms
def _softcap(cap: float, logits: torch.Tensor) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap  # the op order of Gemma2/3's forward


def _mul(factor: float, logits: torch.Tensor) -> torch.Tensor:
    return logits * factor


def _div(factor: float, logits: torch.Tensor) -> torch.Tensor:
    return logits / factor


def _mul_attr(owner: Any, name: str, logits: torch.Tensor) -> torch.Tensor:
    return logits * getattr(owner, name)  # read at each forward, as the model's own forward does


# config / model attributes of known post-lm_head logit transforms we cannot map to a formula here
_UNKNOWN_SCALES = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier",
                   "output_multiplier_scale")
# model types whose scale attribute divides the hidden states BEFORE lm_head (the fused head gets them scaled):
# no logit transform (MiniCPM3: hidden_states / config.logits_scaling, then lm_head)
_PRE_HEAD_SCALE = ("minicpm3",)


def _scale(base: torch.nn.Module, cfg: Any, model_type: str) -> tuple[bool, Callable | None]:
    """(whether this model type's post-lm_head scale is known, the scale as a function or None)."""
    scaling = getattr(cfg, "logits_scaling", None)
    if model_type.startswith("cohere") and isinstance(getattr(base, "logit_scale", None), int | float):
        return True, functools.partial(_mul, float(base.logit_scale))  # Cohere: logits * logit_scale
    if model_type.startswith("granite") and scaling is not None:
        return True, functools.partial(_div, float(scaling))  # Granite: logits / logits_scaling
    if model_type == "hyperclovax" and scaling is not None:
        return True, functools.partial(_mul, float(scaling))  # HyperCLOVA X: lm_head(h) * logits_scaling
    inner = getattr(base, "model", None)
    if model_type == "falcon_h1" and hasattr(inner, "lm_head_multiplier"):  # muP: lm_head(h) * model.lm_head_multiplier
        return True, functools.partial(_mul_attr, inner, "lm_head_multiplier")
    return model_type in _PRE_HEAD_SCALE, None


def _logits_transform(base: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the model's forward does to lm_head's output, as a function (None: nothing), or SeqParError."""
    cfg = getattr(base, "config", None)
    model_type = str(getattr(cfg, "model_type", ""))
    found: list[Callable] = []
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap is None and model_type == "recurrent_gemma":  # RecurrentGemma's own name for it (tanh(l / cap) * cap too)
        cap = getattr(cfg, "logits_soft_cap", None)
    if cap is not None:
        found.append(functools.partial(_softcap, float(cap)))
    known, scale = _scale(base, cfg, model_type)
    if scale is not None:
        found.append(scale)
    elif not known:
        unknown = [a for a in _UNKNOWN_SCALES if getattr(cfg, a, None) is not None or
                   isinstance(getattr(base, a, None), int | float)]
        if unknown:
            raise SeqParError(
                f"{type(base).__name__} scales its logits after lm_head ({', '.join(unknown)}), which the fused "
                f"loss does not reproduce: {FUSED_OFF_HINT}"
            )
    if len(found) > 1:
        raise SeqParError(f"{type(base).__name__} both softcaps and scales its logits: {FUSED_OFF_HINT}")
    return found[0] if found else None


# ----------------------------------------------------------------------------- public API
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return base_model(model)


def install_fused_head(model: torch.nn.Module) -> _FusedHead:
    """Install (once; idempotent) the fused-loss forward on the model's output embeddings.

    model: an HF causal LM, possibly wrapped by PEFT / DDP / FSDP2. Raises SeqParError, before any
    forward (so identically on every rank), for a model without output embeddings or with a
    post-lm_head logit transform the fused loss cannot reproduce.
    """
    base = _unwrap(model)
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Module):
        raise SeqParError(f"{type(base).__name__} has no output embeddings (get_output_embeddings()): {FUSED_OFF_HINT}")
    state = head.__dict__.get(_STATE)
    if state is None:
        state = _FusedHead(head.forward, _logits_transform(base))
        head.__dict__[_STATE] = state
        head.forward = _fused_forward.__get__(head)  # instance attribute: no module replaced, same state_dict
    return state


def default_chunk_tokens(model: torch.nn.Module) -> int:
    """Tokens per chunk so that one chunk's fp32 logits stay <= 256 MB (vocab = output embedding rows)."""
    base = _unwrap(model)
    head = base.get_output_embeddings()
    weight = getattr(head, "weight", None)
    # DeepSpeed ZeRO-3 keeps a partitioned parameter as an empty tensor and its real shape in ds_shape.
    shape = getattr(weight, "ds_shape", getattr(weight, "shape", None))
    vocab = int(shape[0]) if shape is not None and len(shape) == 2 else int(base.config.vocab_size)
    return max(1, _CHUNK_BYTES // (4 * vocab))


@contextmanager
def fused_targets(model: torch.nn.Module, shift_labels: torch.Tensor, chunk_tokens: int | None = None,
                  ignore_index: int = L.IGNORE_INDEX, *, temperature: float = 1.0,
                  entropy: bool = False, metrics: dict[str, torch.Tensor] | None = None) -> Iterator[FusedRequest]:
    """Within the block, the model's forward computes the per-token NLL of `shift_labels` [B, S_local]
    (chunks of `chunk_tokens` supervised tokens; None: `default_chunk_tokens`) instead of logits;
    read it with `request.result(output)`. temperature: the NLL (and entropy) of softmax(logits / T);
    entropy=True: also the per-token entropy, read with `request.entropy_result(output)`.
    metrics: a dict the head fills with the detached per-token seqpar.loss.TOKEN_METRICS (entropy, is_top1,
    mean_logits; [B, S_local], 0 where not supervised) from the same chunks, without gradient (logging)."""
    if chunk_tokens is not None and chunk_tokens < 1:
        raise SeqParError(f"loss_chunk_tokens must be >= 1, got {chunk_tokens}")
    if shift_labels.dim() != 2 or shift_labels.dtype.is_floating_point:
        raise SeqParError(f"shift_labels must be an integer [B, S_local] tensor, got {tuple(shift_labels.shape)} "
                          f"{shift_labels.dtype}")
    state = install_fused_head(model)
    if state.request is not None:
        raise SeqParError("fused_targets is already active for this model (nested forwards are not supported)")
    if not temperature > 0:
        raise SeqParError(f"temperature must be > 0, got {temperature}")
    req = FusedRequest(shift_labels, chunk_tokens or default_chunk_tokens(model), ignore_index,
                       temperature=float(temperature), want_entropy=bool(entropy), metrics=metrics)
    state.request = req
    try:
        yield req
    finally:
        state.request = None
