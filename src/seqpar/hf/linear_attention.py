"""Sequence-parallel Gated DeltaNet (the linear-attention layers of Qwen3-Next / Qwen3.5 / OLMo-hybrid): Ulysses,
ring, USP.

A Gated DeltaNet layer (transformers' `Qwen3NextGatedDeltaNet.forward`, `Qwen3_5GatedDeltaNet.forward`,
`OlmoHybridGatedDeltaNet.forward`: its own q / k / v / gate projections, beta doubled with allow_neg_eigval):
per-token input projections -> depthwise causal Conv1d over the sequence on the q|k|v channels ->
gated delta-rule recurrence per head over the sequence -> gated RMSNorm per v-head vector -> out_proj.
Only the conv and the recurrence look along the sequence, and both are independent per head (per channel):

- Ulysses: after the per-token projections on the local shard, one all-to-all turns sequence shards into
  k-head-GROUP shards of the ring rank's sequence (a rank owns num_k_heads / U k heads and the v heads under
  them); the conv runs with this rank's channel slice of `conv1d.weight`, the recurrence with its slice of
  `A_log` / `dt_bias` (slicing a parameter is differentiable: LoRA / FSDP still see the layer's own
  parameters used); a second all-to-all returns the outputs to sequence shards for the norm and out_proj.
- Ring (and USP, ring across Ulysses groups): the ring rank's segments are stretches of the sequence, so the
  conv gets its history and the recurrence its incoming state from the chunks before them, by state passing
  (seqpar.recurrent: each rank runs its pieces from a zero state in parallel, the ring combines the pieces'
  affine transitions, outputs are corrected with the incoming state; backward by autograd through the same
  ops). Zigzag segments are handled in global order; packed documents restart conv and state at every boundary.

The conv and the recurrence are the functions the layer's own forward calls (hf.layer_kernels: the torch
fallbacks, or flash-linear-attention / causal-conv1d / a hub kernel where transformers uses one).

Refused (SeqParError at apply time, identically on every rank, before any collective): k-head counts the
Ulysses degree does not divide.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh, divisors
from ..recurrent import delta_piece, ring_plan, ring_recurrence
from .layer_kernels import layer_function, takes_grouped_heads

__all__ = ["LINEAR_ATTENTION_CLASSES", "find_linear_attention", "check_linear_attention", "sp_gated_delta_forward",
           "head_space_plan"]

# Layers whose forward sp_gated_delta_forward reproduces (same algorithm; they differ only in the projections).
LINEAR_ATTENTION_CLASSES = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                            "OlmoHybridGatedDeltaNet")


def find_linear_attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The supported Gated DeltaNet layers of `model`, in module order."""
    return [m for m in model.modules() if type(m).__name__ in LINEAR_ATTENTION_CLASSES]


def check_linear_attention(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """Raise SeqParError (same on every rank: depends on config and mesh only) if SP cannot run these layers."""
    if not layers:
        return
    p = mesh.ulysses_degree
    for layer in layers:
        nk, nv = int(layer.num_k_heads), int(layer.num_v_heads)
        if nv % nk != 0:
            raise SeqParError(f"{type(layer).__name__}: num_v_heads={nv} is not a multiple of num_k_heads={nk}")
        if nk % p != 0:
            raise SeqParError(
                f"{type(layer).__name__} has {nk} key heads (linear_num_key_heads), which the Ulysses degree {p} "
                f"does not divide: each rank must own whole k-head groups. Use an SP size among {divisors(nk)}"
            )


def _project(layer: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-token projections: q, k [B,s,nk,dk]; v, z [B,s,nv,dv]; b, a [B,s,nv] (upstream's ordering)."""
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: q|k|v|z interleaved per k-head group
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(h), layer.in_proj_ba(h))
        return q, k, v, z, b, a
    # Qwen3.5: separate projections, q|k|v flat as the conv sees them (OLMo-hybrid: one projection each)
    bsz, s, _ = h.shape
    if hasattr(layer, "q_proj"):
        q, k, v = layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)
        z, b, a = layer.g_proj(h), layer.b_proj(h), layer.a_proj(h)
        return (q.reshape(bsz, s, -1, layer.head_k_dim), k.reshape(bsz, s, -1, layer.head_k_dim),
                v.reshape(bsz, s, -1, layer.head_v_dim), z.reshape(bsz, s, -1, layer.head_v_dim), b, a)
    q, k, v = torch.split(layer.in_proj_qkv(h), [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    q = q.reshape(bsz, s, -1, layer.head_k_dim)
    k = k.reshape(bsz, s, -1, layer.head_k_dim)
    v = v.reshape(bsz, s, -1, layer.head_v_dim)
    z = layer.in_proj_z(h).reshape(bsz, s, -1, layer.head_v_dim)
    return q, k, v, z, layer.in_proj_b(h), layer.in_proj_a(h)


def _delta_piece_fn(layer: torch.nn.Module, nk_l: int) -> Any:
    """The engine's piece function: conv output [b, L, C] + (beta, g) -> the delta rule on the piece."""
    kd, vd = layer.head_k_dim, layer.head_v_dim
    rule = layer_function(layer, "torch_chunk_gated_delta_rule")  # FLA's kernel where the layer runs it
    repeat = 1 if takes_grouped_heads(layer) else layer.num_v_heads // layer.num_k_heads

    def piece(y: torch.Tensor, side: tuple[torch.Tensor, ...], carries: bool) -> Any:
        b, n = y.shape[:2]
        q, k, v = torch.split(y, [nk_l * kd, nk_l * kd, y.shape[-1] - 2 * nk_l * kd], dim=-1)
        beta, g = side
        q, k = (t.reshape(b, n, nk_l, kd) for t in (q, k))
        if repeat > 1:  # v head j reads k head j // repeat (repeat_interleave copies even by 1)
            q, k = (t.repeat_interleave(repeat, dim=2) for t in (q, k))
        return delta_piece(rule, q, k, v.reshape(b, n, -1, vd), g, beta, carries)

    return piece


def _param_slices(layer: torch.nn.Module, rank: int, p: int) -> tuple:
    """This rank's channels of conv1d (q, k and v channels of its k-head group) and its v heads' A_log, dt_bias."""
    kd, nk_l = layer.head_k_dim, layer.num_k_heads // p
    vd_l = layer.value_dim // p
    qs = slice(rank * nk_l * kd, (rank + 1) * nk_l * kd)
    ks = slice(layer.key_dim + qs.start, layer.key_dim + qs.stop)
    vs = slice(2 * layer.key_dim + rank * vd_l, 2 * layer.key_dim + (rank + 1) * vd_l)
    w = layer.conv1d.weight.squeeze(1)
    weight = torch.cat([w[qs], w[ks], w[vs]]) if p > 1 else w
    bias = layer.conv1d.bias
    if bias is not None and p > 1:
        bias = torch.cat([bias[qs], bias[ks], bias[vs]])
    nv_l = layer.num_v_heads // p
    heads = slice(rank * nv_l, (rank + 1) * nv_l)
    return weight, bias, layer.A_log[heads], layer.dt_bias[heads]


def head_space_plan(mesh: SequenceParallelMesh, full_len: int, row_bounds: tuple[tuple[int, ...], ...]) -> Any:
    """The ring plan of this rank's head-space sequence (its ring rank's segments, after Ulysses' all-to-all)."""
    return ring_plan(full_len, mesh.ring_degree, mesh.ring_rank, mesh.effective_layout, row_bounds)


def sp_gated_delta_forward(
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    row_bounds: tuple[tuple[int, ...], ...],
    mesh: SequenceParallelMesh,
) -> torch.Tensor:
    """The layer's forward on this rank's sequence shard [B, S/sp, H] (the mesh's layout) -> [B, S/sp, H].

    `row_bounds`: per row, the inner packed-document starts in the full sequence (ForwardPlan.row_bounds).
    Ring ranks combine their chunks' states as mesh.state_passing says (seqpar.recurrent.combine).
    """
    fns = sys.modules[type(layer).__module__]  # the layer's own conv / recurrence functions
    if attention_mask is not None:  # 2-D padding mask of the local shard (upstream zeroes padded states)
        hidden_states = fns.apply_mask_to_padding_states(hidden_states, attention_mask)
    q, k, v, z, b, a = _project(layer, hidden_states)
    bsz, s_loc, nk, dk = q.shape
    r = layer.num_v_heads // nk
    # One all-to-all for all five per-head tensors, grouped by k head: [B, s, nk, 2dk + r*dv + 2r].
    packed = torch.cat([q, k, v.reshape(bsz, s_loc, nk, -1), b.reshape(bsz, s_loc, nk, r),
                        a.reshape(bsz, s_loc, nk, r)], dim=-1)
    group, dev = mesh.ulysses_group, mesh.comm_device
    packed = seq_to_heads(packed, group, mesh.stats, device=dev)  # [B, n, nk/U, C]: the ring rank's segments
    n, nk_l = packed.shape[1], packed.shape[2]
    qh, kh, vh, bh, ah = torch.split(packed, [dk, dk, r * layer.head_v_dim, r, r], dim=-1)
    weight, bias, a_log, dt_bias = _param_slices(layer, mesh.ulysses_rank, mesh.ulysses_degree)
    mixed = torch.cat([qh.reshape(bsz, n, -1), kh.reshape(bsz, n, -1), vh.reshape(bsz, n, -1)], dim=-1)
    beta = bh.reshape(bsz, n, -1).sigmoid()
    if getattr(layer, "allow_neg_eigval", False):  # OLMo-hybrid: beta in [0, 2]
        beta = beta * 2.0
    g = -a_log.float().exp() * F.softplus(ah.reshape(bsz, n, -1).float() + dt_bias)  # as upstream (A_log in fp32)

    conv_fn = layer_function(layer, "causal_conv1d_fn")

    def conv(x: torch.Tensor) -> torch.Tensor:
        return conv_fn(x.transpose(1, 2), weight, bias, activation=layer.activation).transpose(1, 2)

    plan = head_space_plan(mesh, s_loc * mesh.sp_size, row_bounds)
    out = ring_recurrence(mixed, (beta, g), plan, mesh, conv, _delta_piece_fn(layer, nk_l), "matrix",
                          int(layer.conv_kernel_size), mesh.state_passing)  # [B, n, nv/U, dv]
    out = heads_to_seq(out.contiguous(), group, mesh.stats, device=dev)  # [B, s, nv, dv]
    # Per token, as upstream: gated RMSNorm per v-head vector, then out_proj.
    norm, out_proj = (layer.o_norm, layer.o_proj) if hasattr(layer, "o_proj") else (layer.norm, layer.out_proj)
    normed = norm(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return out_proj(normed.reshape(bsz, s_loc, -1))
