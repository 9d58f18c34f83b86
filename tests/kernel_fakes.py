"""Fake kernel packages for the hybrid layers' GPU kernels: `causal_conv1d` (causal-conv1d), `mamba_ssm` (its
`ops.selective_scan_interface.selective_scan_fn`) and `fla` (flash-linear-attention's `ops.kda.chunk_kda`).

Each fake has the package function's documented signature (no **kwargs: an argument the kernel does not take is a
TypeError, as with the real one), checks the documented argument rules (layouts, dtypes, widths, activations),
records every call (`CALLS`: name -> list of summaries), and computes in torch (transformers' own torch fallback of
the same function, or the math written here where the fallback lacks an argument, e.g. the conv's initial states).

`installed(module, names)` puts the fake packages into sys.modules and rebinds the module's functions the way
transformers binds them when the package is importable (`use_kernel_func_from_hub_with_fallback`: its dispatch
wrapper, which keeps only the arguments the kernel's signature names), so the unsharded layer and seqpar's SP
forward both run the fakes exactly as they would run the real kernels.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

CALLS: dict[str, list[dict]] = {}
_LOCK = threading.Lock()
_TORCH: dict[str, object] = {}  # name -> transformers' torch fallback the fake computes with


def _record(name: str, **summary) -> None:
    with _LOCK:
        CALLS.setdefault(name, []).append(summary)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None):
    """causal-conv1d: x [batch, dim, seqlen], weight [dim, width] (width 2..4), bias [dim], initial_states
    [batch, dim, width - 1], activation None / "silu" / "swish" -> out [batch, dim, seqlen] (and final states)."""
    assert x.dim() == 3 and weight.dim() == 2 and x.shape[1] == weight.shape[0], (x.shape, weight.shape)
    assert 2 <= weight.shape[1] <= 4, f"causal-conv1d takes widths 2..4, got {weight.shape[1]}"
    assert activation in (None, "silu", "swish"), activation
    assert bias is None or bias.shape == (weight.shape[0],)
    assert seq_idx is None and final_states_out is None
    _record("causal_conv1d_fn", shape=tuple(x.shape), initial_states=initial_states is not None,
            return_final_states=bool(return_final_states), activation=activation)
    w = weight.shape[1]
    pre = (initial_states if initial_states is not None else x.new_zeros(x.shape[0], x.shape[1], w - 1))
    full = torch.cat([pre.to(x.dtype), x], dim=-1)
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), bias, groups=x.shape[1])
    out = (F.silu(out) if activation is not None else out).to(x.dtype)
    return (out, full[..., -(w - 1):]) if return_final_states else out


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """mamba_ssm: u, delta, z [batch, dim, seqlen], A [dim, dstate] (fp32), B / C [batch, dstate, seqlen] (or
    [batch, groups, dstate, seqlen]), D / delta_bias [dim] (fp32) -> out [batch, dim, seqlen] (and the last state
    [batch, dim, dstate]). No initial state: the kernel always starts from zero."""
    assert u.dim() == 3 and delta.shape == u.shape and A.shape[0] == u.shape[1], (u.shape, delta.shape, A.shape)
    assert A.dtype == torch.float32 and B.shape[-1] == u.shape[-1] and C.shape == B.shape
    assert D is None or (D.shape == (u.shape[1],) and D.dtype == torch.float32)
    assert delta_bias is None or (delta_bias.shape == (u.shape[1],) and delta_bias.dtype == torch.float32)
    assert z is None or z.shape == u.shape
    _record("selective_scan_fn", shape=tuple(u.shape), return_last_state=bool(return_last_state),
            delta_softplus=bool(delta_softplus), z=z is not None, delta_bias=delta_bias is not None)
    return _TORCH["mamba_selective_scan"](u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                          delta_softplus=delta_softplus, return_last_state=return_last_state)


def _delta_rule(kernel: str, name: str, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, per_key: bool):
    """The argument rules flash-linear-attention's chunked delta rules share; the call recorded, then computed."""
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    assert k.shape == q.shape and v.shape[:2] == (b, t) and hv % hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == ((b, t, hv, dk) if per_key else (b, t, hv)) and beta.shape == (b, t, hv), (g.shape, beta.shape)
    assert cu_seqlens is None and (scale is None or abs(scale - dk ** -0.5) < 1e-12)
    if initial_state is not None:
        assert initial_state.shape == (b, hv, dk, v.shape[3]), initial_state.shape
        assert initial_state.dtype in (torch.float32, torch.float64)
    _record(kernel, shape=tuple(v.shape), initial_state=initial_state is not None,
            output_final_state=bool(output_final_state), l2norm=bool(use_qk_l2norm_in_kernel))
    return _TORCH[name](q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """flash-linear-attention's KDA: q, k, g [B, T, H, K] (g: a log-decay per key channel), v [B, T, H, V], beta
    [B, T, H], initial_state [B, H, K, V] (fp32) -> (o [B, T, H, V], final state [B, H, K, V] or None)."""
    return _delta_rule("chunk_kda", "chunk_kimi_delta_attention", q, k, v, g, beta, scale, initial_state,
                       output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, per_key=True)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """flash-linear-attention's Gated DeltaNet: q, k [B, T, Hk, K], v [B, T, H, V] (H a multiple of Hk), g / beta
    [B, T, H], initial_state [B, H, K, V] (fp32) -> (o [B, T, H, V], final state [B, H, K, V] or None)."""
    return _delta_rule("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule", q, k, v, g, beta, scale,
                       initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, per_key=False)


# transformers' module function -> (the package transformers dispatches it to, the path in it, the fake)
FAKES = {
    "causal_conv1d_fn": ("causal_conv1d", "", causal_conv1d_fn),
    "mamba_selective_scan": ("mamba_ssm", "ops.selective_scan_interface", selective_scan_fn),
    "chunk_kimi_delta_attention": ("fla", "ops.kda", chunk_kda),
    "torch_chunk_gated_delta_rule": ("fla", "ops.gated_delta_rule", chunk_gated_delta_rule),
}


def _package(root: str, path: str, fn) -> dict[str, types.ModuleType]:
    """sys.modules entries of a fake package `root` with `fn` at `root.path`."""
    mods = {root: types.ModuleType(root)}
    mods[root].__path__ = []  # a package
    parent, name = mods[root], root
    for part in [p for p in path.split(".") if p]:
        name = f"{name}.{part}"
        mods[name] = types.ModuleType(name)
        mods[name].__path__ = []
        setattr(parent, part, mods[name])
        parent = mods[name]
    fn.__module__ = name
    setattr(parent, fn.__name__, fn)
    return mods


@contextlib.contextmanager
def installed(module: types.ModuleType, names: tuple[str, ...]) -> Iterator[None]:
    """The fake packages of `names` importable, and `module`'s functions rebound through transformers' dispatch
    as when they are installed; CALLS cleared. Restores everything on exit."""
    from transformers.integrations import use_kernel_func_from_hub_with_fallback

    saved_mods = {k: sys.modules.get(k) for k in list(sys.modules)}
    saved_fns = {n: getattr(module, n) for n in names}
    CALLS.clear()
    try:
        for n in names:
            root, path, fake = FAKES[n]
            sys.modules.update(_package(root, path, fake))
            _TORCH[n] = inspect.unwrap(saved_fns[n])
            kernel = fake.__name__
            setattr(module, n, use_kernel_func_from_hub_with_fallback(kernel, root, path or None)(_TORCH[n]))
        yield
    finally:
        for n, fn in saved_fns.items():
            setattr(module, n, fn)
        for k in [k for k in sys.modules if k not in saved_mods]:
            del sys.modules[k]
