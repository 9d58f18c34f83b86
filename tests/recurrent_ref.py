"""Independent float64 references for the recurrent layers: token-by-token loops, written from the equations.

- gated delta rule (Gated DeltaNet): S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t,
  with q, k L2-normalised (eps 1e-6 inside the rsqrt, as transformers / FLA) and q scaled by dk^-1/2;
- Mamba2 SSD: dt_t = clamp(softplus(dt_t + dt_bias)), h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,
  y_t = h_t C_t + D x_t;
- Mamba1's selective scan (per channel and state entry; see naive_selective_scan);
- Kimi Delta Attention (the gated delta rule with a decay per key channel; naive_kda);
- RecurrentGemma's RG-LRU scan: h_t = a_t h_{t-1} + x_t, a_t = 0 at a reset token (naive_rg_lru_scan).
They keep the dtype they are given (transformers' torch paths compute in fp32 even for fp64 inputs), and have the
signatures of transformers' `torch_chunk_gated_delta_rule` / `mamba2_chunk_scan`, so a test can put them in the
model's module for the unsharded reference AND the SP run (`patched_float64_kernels`).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F


def naive_gated_delta(query, key, value, g, beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule (Gated DeltaNet): KDA with one decay per head (g [b, L, h]), q / k heads repeated to v's."""
    r = value.shape[2] // key.shape[2]
    q, k = query.repeat_interleave(r, 2), key.repeat_interleave(r, 2)
    return naive_kda(q, k, value, g[..., None].expand(*g.shape, k.shape[-1]), beta, initial_state,
                     output_final_state, use_qk_l2norm_in_kernel)


def naive_kda(query, key, value, g, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """Kimi Delta Attention: the gated delta rule with a decay per key channel, g [b, L, h, dk]:
    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t."""
    q, k = query, key
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    b, n, h, dv = value.shape
    s = torch.zeros(b, h, k.shape[-1], dv, dtype=value.dtype) if initial_state is None else initial_state.to(value)
    outs = []
    for t in range(n):
        s = s * g[:, t].to(s.dtype).exp()[..., None]
        read = (s * k[:, t, :, :, None]).sum(-2)
        s = s + k[:, t, :, :, None] * ((value[:, t] - read) * beta[:, t, :, None].to(s.dtype))[:, :, None, :]
        outs.append((s * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, 1), (s if output_final_state else None)


def naive_ssd(hidden_states, dt, A, B, C, chunk_size=None, D=None, dt_bias=None, initial_states=None,
              dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    x = hidden_states
    b, n, h, p = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    rep = h // B.shape[2]
    bb, cc = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    s = torch.zeros(b, h, p, B.shape[-1], dtype=x.dtype) if initial_states is None else initial_states.to(x)
    ys = []
    for t in range(n):
        s = (dt[:, t] * A).exp()[..., None, None] * s + (dt[:, t, :, None, None] * x[:, t, :, :, None]
                                                         * bb[:, t, :, None, :])
        y = (s * cc[:, t, :, None, :]).sum(-1)
        ys.append(y + (D[:, None] * x[:, t] if D is not None else 0))
    y = torch.stack(ys, 1)
    return (y, s) if return_final_states else y


def naive_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         return_last_state=False, **kwargs):
    """Mamba1: dt_t = softplus(dt_t + bias), h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t,
    y_t = (h_t C_t + D x_t) silu(z_t); channels first ([b, d, L]; B, C [b, n, L]), in the dtype of x."""
    x, acc = hidden_states, hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(acc)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    a, s, ys = A.to(acc), x.new_zeros(x.shape[0], x.shape[1], A.shape[-1]), []
    for t in range(x.shape[-1]):
        s = (dt[:, :, t, None] * a).exp() * s + dt[:, :, t, None] * x[:, :, t, None] * B[:, None, :, t].to(acc)
        ys.append((s * C[:, None, :, t].to(acc)).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + x * D.to(acc)[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, s) if return_last_state else y


def naive_rg_lru_scan(self, hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=None):
    """RecurrentGemmaRglru._rnn_scan's signature (a method; transformers' loop accumulates in fp32): per channel
    h_t = a_t h_{t-1} + x_t with a_t = 0 where reset, from `recurrent_states` (zeros if None), in the dtype of x.
    Returns (h [b, L, C], h_L [b, C])."""
    x = hidden_states
    a = recurrent_gate.to(x.dtype) * ~reset
    h = x.new_zeros(x.shape[0], x.shape[2]) if recurrent_states is None else recurrent_states.to(x.dtype)
    ys = []
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1), h


@contextlib.contextmanager
def patched_float64_kernels(*modules: str):
    """Swap the named transformers modeling modules' recurrence functions for the float64-faithful loops."""
    saved = []
    for name in modules:
        mod = sys.modules[name]
        if hasattr(mod, "RecurrentGemmaRglru"):  # a method, not a module function
            saved.append((mod.RecurrentGemmaRglru, "_rnn_scan", mod.RecurrentGemmaRglru._rnn_scan))
            mod.RecurrentGemmaRglru._rnn_scan = naive_rg_lru_scan
        for attr, fn in (("torch_chunk_gated_delta_rule", naive_gated_delta), ("mamba2_chunk_scan", naive_ssd),
                         ("mamba_selective_scan", naive_selective_scan), ("chunk_kimi_delta_attention", naive_kda)):
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, fn)
    try:
        yield
    finally:
        for mod, attr, fn in saved:
            setattr(mod, attr, fn)
