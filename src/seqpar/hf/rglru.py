"""Sequence-parallel RecurrentGemma recurrent blocks (`RecurrentGemmaRecurrentBlock`: RG-LRU): Ulysses, ring, USP.

The block (transformers 5.24): y = gelu(linear_y(h)); x = linear_x(h) -> depthwise causal Conv1d (kernel
conv1d_width, bias) -> RG-LRU -> times y -> linear_out. The RG-LRU, per channel (its gates block-diagonal: one
block_width x block_width matrix per head of num_attention_heads):
    i_t = sigmoid(x_t W_i + b_i),  r_t = sigmoid(x_t W_a + b_a),  log a_t = -8 r_t softplus(recurrent_param),
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) i_t x_t,
and at a reset token (position_ids == 0) a_t = 0 and the input is not scaled (i_t x_t): a diagonal linear recurrence
(seqpar.recurrent.diagonal_piece). The conv and the recurrence look along the sequence, per channel.

- Ulysses: one all-to-all moves x (and the reset flags) to a slice of the channels over the ring rank's sequence:
  whole gate blocks, so the Ulysses degree must divide num_attention_heads; conv1d, the gates and recurrent_param
  run with the rank's rows (differentiable slices of the layer's parameters). A second all-to-all returns the
  RG-LRU's output for y and linear_out.
- Ring / USP: the conv gets its halo (seqpar.recurrent.ring_conv), the RG-LRU its incoming state by state passing
  (a "diagonal" transition).
Packed documents restart the conv and the state (each document as if run alone, with its own position_ids: a
document that starts at position 0 resets, as upstream). The recurrence is the layer's own `_rnn_scan`, from a zero
state; the conv is its Conv1d's (F.conv1d with the rank's channels). The block ignores the attention mask, as
upstream; it returns (output, None), as upstream.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh, check_ulysses_divides
from ..recurrent import diagonal_piece, ring_conv, ring_recurrence
from .linear_attention import head_space_plan

__all__ = ["RGLRU_CLASSES", "check_rglru", "sp_rglru_forward"]

RGLRU_CLASSES = ("RecurrentGemmaRecurrentBlock",)


def check_rglru(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """Raise SeqParError (same on every rank: config and mesh only) if SP cannot run these blocks."""
    for layer in layers:
        check_ulysses_divides(mesh, int(layer.rg_lru.num_attention_heads), type(layer).__name__,
                              "RG-LRU gate blocks (num_attention_heads)")


def _to_heads(x: torch.Tensor, reset: torch.Tensor,
              mesh: SequenceParallelMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, s, W] sequence shard and its reset flags [B, s] -> this rank's W / U channels over the ring rank's
    sequence, and the flags there ([B, n, 1] bool)."""
    bsz, s, w = x.shape
    u = mesh.ulysses_degree
    flags = reset[:, :, None, None].to(x.dtype).expand(-1, -1, u, 1)
    got = seq_to_heads(torch.cat([x.reshape(bsz, s, u, w // u), flags], dim=-1), mesh.ulysses_group, mesh.stats,
                       device=mesh.comm_device)[:, :, 0]
    return got[..., :-1], got[..., -1:] != 0


def _gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """sigmoid of the block-diagonal gate (upstream's baddbmm over heads); x [b, L, h * bw] -> [b, L, h * bw]."""
    b, n, w = x.shape
    h = weight.shape[0]
    act = x.reshape(b * n, h, w // h).permute(1, 0, 2)
    return torch.sigmoid(torch.baddbmm(bias[:, None, :], act, weight).transpose(0, 1).reshape(b, n, w))


def _rglru_piece(layer: torch.nn.Module, prm: dict[str, torch.Tensor], x: torch.Tensor, reset: torch.Tensor,
                 carries: bool) -> Any:
    """The RG-LRU on one piece (x [b, L, W/U] after the conv; reset [b, L, 1]), upstream's math on the rank's
    channels."""
    fns = sys.modules[type(layer).__module__]
    input_gate = _gate(x, prm["wi"], prm["bi"])
    log_a = -8.0 * _gate(x, prm["wa"], prm["ba"]) * F.softplus(prm["param"])
    multiplier = fns.SqrtBoundDerivative.apply(1 - torch.exp(2 * log_a))
    multiplier = reset + ~reset * multiplier
    normalized = x * input_gate * multiplier.type(x.dtype)

    def scan(v: torch.Tensor, la: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return layer.rg_lru._rnn_scan(hidden_states=v, recurrent_gate=torch.exp(la), reset=reset,
                                      recurrent_states=None)

    # a reset token passes nothing on: -inf (upstream's gate there is exp(log a) * ~reset = 0, its gradient 0)
    return diagonal_piece(scan, normalized, log_a.masked_fill(reset, float("-inf")), carries)


def sp_rglru_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                     row_bounds: tuple[tuple[int, ...], ...], mesh: SequenceParallelMesh,
                     position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
    """The block's forward on this rank's sequence shard [B, S/sp, H] (the mesh's layout; position_ids [B or 1,
    S/sp] its GLOBAL positions) -> ([B, S/sp, H], None)."""
    if position_ids is None:
        raise SeqParError(f"{type(layer).__name__} needs position_ids (its RG-LRU resets where they are 0): call the "
                          "model with position_ids=seqpar.shard(full_position_ids, mesh, 1)")
    y_branch = layer.act_fn(layer.linear_y(hidden_states))
    x = layer.linear_x(hidden_states)
    bsz, s_loc, w = x.shape
    x, reset = _to_heads(x, (position_ids == 0).expand(bsz, s_loc), mesh)
    u, rank = mesh.ulysses_degree, mesh.ulysses_rank
    mine = slice(rank * w // u, (rank + 1) * w // u)
    rg = layer.rg_lru
    heads = slice(rank * rg.num_attention_heads // u, (rank + 1) * rg.num_attention_heads // u)
    conv_w = layer.conv_1d.weight[mine]
    conv_b = layer.conv_1d.bias[mine] if layer.conv_1d.bias is not None else None
    k = int(layer.conv1d_width)

    def conv(t: torch.Tensor) -> torch.Tensor:  # upstream: conv_1d (padding k - 1 on both sides)[..., :L]
        out = F.conv1d(t.transpose(1, 2), conv_w, conv_b, padding=k - 1, groups=conv_w.shape[0])
        return out[..., : t.shape[1]].transpose(1, 2)

    plan = head_space_plan(mesh, s_loc * mesh.sp_size, row_bounds)
    x = ring_conv(x, plan, mesh, conv, k)
    prm = {"wi": rg.input_gate_weight[heads], "bi": rg.input_gate_bias[heads], "wa": rg.recurrent_gate_weight[heads],
           "ba": rg.recurrent_gate_bias[heads], "param": rg.recurrent_param[mine]}

    def piece(t: torch.Tensor, side: tuple[torch.Tensor, ...], carries: bool):
        return _rglru_piece(layer, prm, t, side[0], carries)

    out = ring_recurrence(x, (reset,), plan, mesh, lambda t: t, piece, "diagonal", 1, mesh.state_passing)
    out = heads_to_seq(out[:, :, None].contiguous(), mesh.ulysses_group, mesh.stats, device=mesh.comm_device)
    return layer.linear_out(out.reshape(bsz, s_loc, w) * y_branch), None
