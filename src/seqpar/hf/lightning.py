"""Sequence-parallel MiniMax lightning attention (`MiniMaxLightningAttention`): Ulysses, ring, USP.

The layer (transformers 5.24): silu(qkv_proj(x)) -> per head q | k | v -> linear attention with a constant decay
per head (S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = q_t S_t; computed block by block) -> RMSNorm over all heads
-> times sigmoid(output_gate(x)) -> out_proj. Only the recurrence looks along the sequence, per head:
- Ulysses: one all-to-all moves each rank's heads' q | k | v to the ring rank's sequence (the degree must divide
  num_attention_heads), a second returns the output for the norm, gate and out_proj;
- Ring / USP: state passing (seqpar.recurrent.lightning: a "scalar" transition per head), no conv.
The layer returns (output, None), as upstream's (output, state) with no state kept under SP.
"""

from __future__ import annotations

import sys

import torch

from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..mesh import SequenceParallelMesh, check_ulysses_divides
from ..recurrent import lightning_piece, ring_recurrence
from .linear_attention import head_space_plan

__all__ = ["LIGHTNING_CLASSES", "check_lightning", "sp_lightning_forward"]

LIGHTNING_CLASSES = ("MiniMaxLightningAttention",)


def check_lightning(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """Raise SeqParError (same on every rank: config and mesh only) if SP cannot run these layers."""
    for layer in layers:
        check_ulysses_divides(mesh, int(layer.num_attention_heads), type(layer).__name__, "heads")


def sp_lightning_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                         row_bounds: tuple[tuple[int, ...], ...], mesh: SequenceParallelMesh) -> tuple:
    """The layer's forward on this rank's sequence shard [B, S/sp, H] (the mesh's layout) -> ([B, S/sp, H], None)."""
    fns = sys.modules[type(layer).__module__]
    bsz, s_loc = hidden_states.shape[:2]
    d, heads = layer.head_dim, layer.num_attention_heads
    qkv = fns.apply_mask_to_padding_states(layer.act_fn(layer.qkv_proj(hidden_states)), attention_mask)
    qkv = seq_to_heads(qkv.reshape(bsz, s_loc, heads, 3 * d), mesh.ulysses_group, mesh.stats,
                       device=mesh.comm_device)  # [B, n, h/U, 3d]
    n, hl = qkv.shape[1], qkv.shape[2]
    slope = layer.slope_rate.reshape(-1)[mesh.ulysses_rank * hl : (mesh.ulysses_rank + 1) * hl]
    block = int(layer.block_size)

    def piece(y: torch.Tensor, side: tuple[torch.Tensor, ...], carries: bool):
        q, k, v = torch.split(y.reshape(*y.shape[:2], hl, 3 * d), d, dim=-1)
        return lightning_piece(q, k, v, slope, block, carries)

    plan = head_space_plan(mesh, s_loc * mesh.sp_size, row_bounds)
    out = ring_recurrence(qkv.reshape(bsz, n, -1), (), plan, mesh, lambda t: t, piece, "scalar", 1,
                          mesh.state_passing)  # [B, n, h/U, d]
    out = heads_to_seq(out.contiguous(), mesh.ulysses_group, mesh.stats, device=mesh.comm_device)
    out = layer.norm(out.reshape(bsz, s_loc, heads * d))
    out = torch.sigmoid(layer.output_gate(hidden_states)) * out
    return layer.out_proj(out), None
