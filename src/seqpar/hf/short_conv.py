"""Sequence-parallel short convolutions (LFM2's `Lfm2ShortConv`, LFM2-MoE's, LFM3's): Ulysses, ring, USP.

The layer (transformers 5.24): in_proj -> [B | C | x] -> B * x -> depthwise causal Conv1d (kernel
conv_L_cache, no activation) -> C * conv -> out_proj. Only the conv looks along the sequence, over at most
kernel - 1 earlier tokens, per channel, and carries no state: no recurrence to pass, a halo only.

- Ulysses: one all-to-all moves B * x to a slice of the channels over the ring rank's sequence (the Ulysses
  degree must divide hidden_size); the conv runs with that slice of conv.weight / bias (differentiable slices of
  the layer's parameters) and a second all-to-all returns it for C * (.) and out_proj.
- Ring / USP: each segment's conv gets the kernel - 1 inputs before it from the ring (seqpar.recurrent.ring_conv:
  one all-gather of every segment's tail); packed documents restart the conv at every boundary.

The conv is the function the layer's own forward calls (hf.layer_kernels: `causal_conv1d_fn`, the torch
fallback or causal-conv1d / a hub kernel). A 2-D padding mask zeroes padded tokens before in_proj, as upstream.
"""

from __future__ import annotations

import sys

import torch

from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh, check_ulysses_divides
from ..recurrent import ring_conv
from .layer_kernels import layer_function
from .linear_attention import head_space_plan

__all__ = ["SHORT_CONV_CLASSES", "check_short_conv", "sp_short_conv_forward"]

SHORT_CONV_CLASSES = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")


def check_short_conv(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """Raise SeqParError (same on every rank: config and mesh only) if SP cannot run these convs."""
    for layer in layers:
        ch = int(layer.conv.in_channels)
        if layer.conv.groups != ch or layer.conv.out_channels != ch:
            raise SeqParError(f"{type(layer).__name__}: its conv is not depthwise ({ch} channels in "
                              f"{layer.conv.groups} groups): not a short-conv layout seqpar knows")
        check_ulysses_divides(mesh, ch, type(layer).__name__, "conv channels (hidden_size)")


def sp_short_conv_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                          row_bounds: tuple[tuple[int, ...], ...], mesh: SequenceParallelMesh) -> torch.Tensor:
    """The layer's forward on this rank's sequence shard [B, S/sp, H] (the mesh's layout) -> [B, S/sp, H]."""
    fns = sys.modules[type(layer).__module__]
    hidden_states = fns.apply_mask_to_padding_states(hidden_states, attention_mask)
    b, c, x = layer.in_proj(hidden_states).chunk(3, dim=-1)
    bsz, s_loc, ch = x.shape
    u, rank = mesh.ulysses_degree, mesh.ulysses_rank
    bx = seq_to_heads((b * x).reshape(bsz, s_loc, u, ch // u), mesh.ulysses_group, mesh.stats,
                      device=mesh.comm_device)[:, :, 0]  # [B, n, ch/U]: this rank's channels, ring rank's sequence
    mine = slice(rank * ch // u, (rank + 1) * ch // u)
    weight = layer.conv.weight.squeeze(1)[mine]
    bias = layer.conv.bias[mine] if layer.conv.bias is not None else None
    conv_fn = layer_function(layer, "causal_conv1d_fn")

    def conv(t: torch.Tensor) -> torch.Tensor:
        return conv_fn(t.transpose(1, 2), weight, bias).transpose(1, 2)

    plan = head_space_plan(mesh, s_loc * mesh.sp_size, row_bounds)
    y = ring_conv(bx, plan, mesh, conv, int(layer.conv.kernel_size[0]))
    y = heads_to_seq(y[:, :, None].contiguous(), mesh.ulysses_group, mesh.stats, device=mesh.comm_device)
    return layer.out_proj(c * y.reshape(bsz, s_loc, ch))
