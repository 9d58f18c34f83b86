"""Sequence-parallel Kimi Delta Attention (Kimi-Linear's `KimiLinearDeltaAttention`): Ulysses, ring, USP.

The layer (transformers 5.24): q / k / v projections -> depthwise causal Conv1d (+ silu) over q|k|v -> the delta
rule with a decay per key channel (`chunk_kimi_delta_attention`: S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1}
+ beta_t k_t v_t^T, q / k L2-normalised) -> gated RMSNorm per head (gate from g_a_proj / g_b_proj) -> o_proj. The
forget gate g [.., heads, head_dim] and beta come from per-token projections (KimiLinearForgetGate, b_proj).

The recurrence is linear in the state and its transition does not read v, so the Gated DeltaNet piece serves it
as is (recurrent.delta_piece: one kernel call with [v | 0] from [0 | I] gives the transition and the correction).
- Ulysses: one all-to-all moves q, k, v, g and beta of a rank's heads to the ring rank's sequence (the degree must
  divide linear_num_heads; g, which upstream keeps in fp32, travels in fp32 on its own when q is lower precision);
  the conv runs with the rank's channels of conv1d.weight; a second all-to-all returns the output.
- Ring / USP: conv halo + "matrix" state passing (seqpar.recurrent), as for Gated DeltaNet.
"""

from __future__ import annotations

import sys

import torch

from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..mesh import SequenceParallelMesh, check_ulysses_divides
from ..recurrent import delta_piece, ring_recurrence
from .layer_kernels import layer_function
from .linear_attention import head_space_plan

__all__ = ["KDA_CLASSES", "check_kda", "sp_kda_forward"]

KDA_CLASSES = ("KimiLinearDeltaAttention",)


def check_kda(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """Raise SeqParError (same on every rank: config and mesh only) if SP cannot run these layers."""
    for layer in layers:
        check_ulysses_divides(mesh, int(layer.num_heads), type(layer).__name__, "heads (linear_num_heads)")


def _to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              mesh: SequenceParallelMesh) -> tuple[torch.Tensor, ...]:
    """[B, s, h, d] sequence shards -> this rank's heads over the ring rank's sequence (q, k, v, g, beta)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return seq_to_heads(t, mesh.ulysses_group, mesh.stats, device=mesh.comm_device)

    d = q.shape[-1]
    if q.dtype in (torch.float32, torch.float64):
        got = move(torch.cat([q, k, v, g.to(q.dtype), beta[..., None].to(q.dtype)], dim=-1))
        qh, kh, vh, gh, bh = torch.split(got, [d, d, d, d, 1], dim=-1)
        return qh, kh, vh, gh.to(g.dtype), bh[..., 0].to(beta.dtype)
    qh, kh, vh, bh = torch.split(move(torch.cat([q, k, v, beta[..., None]], dim=-1)), [d, d, d, 1], dim=-1)
    return qh, kh, vh, move(g.contiguous()), bh[..., 0]


def sp_kda_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                   row_bounds: tuple[tuple[int, ...], ...], mesh: SequenceParallelMesh) -> torch.Tensor:
    """The layer's forward on this rank's sequence shard [B, S/sp, H] (the mesh's layout) -> [B, S/sp, H]."""
    fns = sys.modules[type(layer).__module__]
    hidden_states = fns.apply_mask_to_padding_states(hidden_states, attention_mask)
    bsz, s_loc = hidden_states.shape[:2]
    shape = (bsz, s_loc, -1, layer.head_dim)
    q, k, v = (p(hidden_states).view(shape) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    g = layer.forget_gate(hidden_states)  # [B, s, h, d], fp32 as upstream
    beta = torch.sigmoid(layer.b_proj(hidden_states))
    qh, kh, vh, gh, bh = _to_heads(q, k, v, g, beta, mesh)
    n, hl, d = qh.shape[1], qh.shape[2], layer.head_dim
    u, rank = mesh.ulysses_degree, mesh.ulysses_rank
    w = layer.conv1d.weight.squeeze(1)
    weight = torch.cat([w[i * layer.qkv_dim + rank * hl * d: i * layer.qkv_dim + (rank + 1) * hl * d]
                        for i in range(3)]) if u > 1 else w
    conv_fn = layer_function(layer, "causal_conv1d_fn")
    rule = layer_function(layer, "chunk_kimi_delta_attention")

    def conv(t: torch.Tensor) -> torch.Tensor:
        return conv_fn(t.transpose(1, 2), weight, None, activation=layer.activation).transpose(1, 2)

    def piece(y: torch.Tensor, side: tuple[torch.Tensor, ...], carries: bool):
        b, length = y.shape[:2]
        qp, kp, vp = (t.reshape(b, length, hl, d) for t in torch.split(y, [hl * d] * 3, dim=-1))
        return delta_piece(rule, qp, kp, vp, side[0], side[1], carries)

    mixed = torch.cat([t.reshape(bsz, n, -1) for t in (qh, kh, vh)], dim=-1)
    plan = head_space_plan(mesh, s_loc * mesh.sp_size, row_bounds)
    out = ring_recurrence(mixed, (gh, bh), plan, mesh, conv, piece, "matrix", int(layer.conv_kernel_size),
                          mesh.state_passing)  # [B, n, h/U, d]
    out = heads_to_seq(out.contiguous(), mesh.ulysses_group, mesh.stats, device=mesh.comm_device)
    gate = layer.g_b_proj(layer.g_a_proj(hidden_states)).view(shape)
    return layer.o_proj(layer.o_norm(out, gate).reshape(bsz, s_loc, -1))
