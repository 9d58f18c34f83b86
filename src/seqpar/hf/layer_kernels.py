"""The conv / recurrence functions a hybrid layer's own forward calls, for its sequence-parallel forward.

seqpar's SP forward of a Gated DeltaNet or Mamba2 layer (hf.linear_attention, hf.mamba2) runs the layer's conv and
recurrence on pieces of the sequence with state passing (initial states, per-document restarts). It must run the
SAME functions the unsharded layer runs, so that a kernel package the user installed is used under SP too, with
the same numerics: flash-linear-attention's `chunk_gated_delta_rule`, causal-conv1d's `causal_conv1d_fn`,
mamba_ssm's scan, or a hub kernel. transformers binds them in one of two ways, and `layer_function` follows both:
- recent releases: module functions (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`, `mamba2_chunk_scan`)
  wrapped to dispatch to the installed package (or hub kernel) when there is one, else the torch fallback;
- earlier releases: attributes set on the layer in `__init__` (`self.chunk_gated_delta_rule = chunk_gated_delta_rule
  or torch_chunk_gated_delta_rule`, `self.causal_conv1d_fn = causal_conv1d_fn`, None without the package).
An attribute on the layer wins (it is what that layer's forward calls); a conv missing in both places runs the
depthwise causal convolution in torch, as the layer's own fallback does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import SeqParError

__all__ = ["layer_function", "torch_causal_conv1d", "kernel_origin", "takes_grouped_heads"]

# module function name -> the attribute names layers of earlier transformers releases bind it to
_ON_LAYER = {
    "torch_chunk_gated_delta_rule": ("chunk_gated_delta_rule",),
    "causal_conv1d_fn": ("causal_conv1d_fn",),
    "mamba2_chunk_scan": (),
    "mamba_selective_scan": (),
    "chunk_kimi_delta_attention": (),
}


def torch_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        activation: str | None = None, **_: object) -> torch.Tensor:
    """Depthwise causal conv1d over x [B, C, L] with weight [C, K]: the layers' own torch path."""
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=x.shape[1])[..., : x.shape[-1]]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise SeqParError(f"causal conv activation {activation!r} is not supported under SP: use silu")
    return out.to(x.dtype)


def layer_function(layer: torch.nn.Module, name: str) -> Callable:
    """The function `name` (one of _ON_LAYER's keys) as `layer`'s own forward would call it."""
    for attr in _ON_LAYER[name]:
        fn = layer.__dict__.get(attr, getattr(type(layer), attr, None))
        if callable(fn):
            return fn
    fn = getattr(sys.modules[type(layer).__module__], name, None)
    if callable(fn):
        return fn
    if name == "causal_conv1d_fn":
        return torch_causal_conv1d
    raise SeqParError(f"{type(layer).__name__}: its module {type(layer).__module__} has no {name}, which seqpar's "
                      "sequence-parallel forward of this layer runs: use the transformers release seqpar is tested "
                      "with (pyproject.toml), or sequence_parallel size 1")


def kernel_origin(fn: Callable) -> str:
    """The module of the function that actually runs when `fn` is called: for transformers' dispatching wrappers
    (use_kernel_func_from_hub_with_fallback) the implementation they chose, e.g. 'fla.ops.gated_delta_rule.chunk'
    or the transformers model module for the torch fallback."""
    cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None) or ()))
    impl = cells["implementation"].cell_contents if "implementation" in cells else fn
    return getattr(impl, "__module__", None) or type(impl).__name__


def takes_grouped_heads(layer: torch.nn.Module) -> bool:
    """Whether the layer's delta-rule function takes fewer q / k heads than v heads (grouped value attention). Only
    transformers releases that say so (`fla_needs_equal_qk_heads`, False) are trusted: earlier ones repeat q / k to
    the v heads in the layer's forward before the call (transformers 5.17's torch function fails on grouped heads),
    and FLA before 0.5 needs equal heads too, so the SP forward repeats them likewise."""
    needs_equal = getattr(sys.modules[type(layer).__module__], "fla_needs_equal_qk_heads", None)
    return callable(needs_equal) and not needs_equal()
