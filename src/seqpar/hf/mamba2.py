"""Sequence-parallel Mamba2 (SSD) mixers of hybrid models: Nemotron-H, Granite 4 (GraniteMoeHybrid), Bamba,
Falcon-H1 (in parallel with attention in every layer), Zamba2 (with a shared attention block).

They share one mixer forward in transformers (5.24: `NemotronHMamba2Mixer`, `GraniteMoeHybridMambaLayer`,
`BambaMixer`, `Zamba2MambaMixer`, `FalconH1Mixer`): in_proj -> [gate | xBC | dt] -> depthwise causal Conv1d over
xBC (x, B, C channels) -> SSD scan per head (`mamba2_chunk_scan`: A = -exp(A_log), dt = clamp(softplus(dt +
dt_bias)), D skip) -> gated RMSNorm (per group of channels, per token) -> out_proj. Falcon-H1 adds muP
multipliers (its input times ssm_in_multiplier, in_proj's output times mup_vector) and may drop the norm
(mamba_rms_norm False: the output times silu(gate)); its decoder layer scales the mixer's output itself. Only the
conv and the scan look along the sequence, both independent per head (x, dt) and per group (B, C), so:

- Ulysses: one all-to-all moves each rank's heads' x channels and dt, and the B / C channels of the groups
  those heads read, to the ring rank's sequence. The Ulysses degree U must divide the head count and either
  divide the group count (a rank owns ng / U groups) or be a multiple of it (each group's B / C go to the U / ng
  ranks whose heads read it: sent twice, the gradients of both copies flow back); the conv runs with this
  rank's channels of conv1d.weight / bias, the scan with its heads' A_log / dt_bias / D (differentiable
  slices of the layer's parameters). A second all-to-all returns the scan output for the norm and out_proj.
- Ring / USP: seqpar.recurrent's state passing (conv halo + scalar-decay transitions), as for Gated DeltaNet.

The conv and the scan are the functions the mixer's own forward calls (hf.layer_kernels; `causal_conv1d_fn`,
`mamba2_chunk_scan`: torch fallbacks or hub kernels). A 2-D padding mask zeroes padded tokens before in_proj
and after the conv, as upstream.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh, divisors
from ..recurrent import SSDParams, ring_plan, ring_recurrence, ssd_piece
from .layer_kernels import layer_function

__all__ = ["MAMBA2_CLASSES", "find_mamba2", "check_mamba2", "mamba2_degrees", "sp_mamba2_forward"]

MAMBA2_CLASSES = ("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer", "FalconH1Mixer",
                  "Zamba2MambaMixer")


def find_mamba2(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The supported Mamba2 mixers of `model`, in module order."""
    return [m for m in model.modules() if type(m).__name__ in MAMBA2_CLASSES]


def mamba2_degrees(num_heads: int, n_groups: int, sp: int | None = None) -> list[int]:
    """Ulysses degrees a Mamba2 mixer with these counts can run at (dividing `sp` when given)."""
    return [u for u in divisors(sp if sp is not None else num_heads)
            if num_heads % u == 0 and (n_groups % u == 0 or u % n_groups == 0)]


def check_mamba2(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """Raise SeqParError (same on every rank: config and mesh only) if SP cannot run these mixers."""
    u = mesh.ulysses_degree
    for layer in layers:
        nh, ng = int(layer.num_heads), int(layer.n_groups)
        if nh % ng != 0:
            raise SeqParError(f"{type(layer).__name__}: {nh} heads are not a multiple of n_groups={ng}")
        if layer.intermediate_size != nh * layer.head_dim:
            raise SeqParError(f"{type(layer).__name__}: intermediate_size={layer.intermediate_size} != heads x "
                              f"head_dim = {nh} x {layer.head_dim}: not a Mamba2 layout seqpar knows")
        if u not in mamba2_degrees(nh, ng, u):
            fit = max(d for d in mamba2_degrees(nh, ng) if mesh.sp_size % d == 0)
            raise SeqParError(
                f"{type(layer).__name__} has {nh} Mamba2 heads in {ng} groups, which the Ulysses degree {u} cannot "
                f"split (it must divide the heads and divide or be a multiple of the groups): use ulysses_degree "
                f"among {mamba2_degrees(nh, ng)} (the rest as ring_degree, e.g. sequence_parallel: "
                f"{{size: {mesh.sp_size}, ulysses_degree: {fit}}})"
            )


def _rank_channels(layer: torch.nn.Module, u: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank u's xBC channel indices (x of its heads, B then C of the groups they read) and its head indices."""
    nh, ng, hd, n = layer.num_heads, layer.n_groups, layer.head_dim, layer.ssm_state_size
    hr = nh // p
    heads = torch.arange(u * hr, (u + 1) * hr)
    groups = torch.arange(u * ng // p, (u + 1) * ng // p) if ng % p == 0 else torch.tensor([u // (p // ng)])
    x = (heads[:, None] * hd + torch.arange(hd)).reshape(-1)
    b = (layer.intermediate_size + groups[:, None] * n + torch.arange(n)).reshape(-1)
    c = b + ng * n
    return torch.cat([x, b, c]), heads


def _to_heads(layer: torch.nn.Module, xbc: torch.Tensor, dt: torch.Tensor, mask: torch.Tensor | None,
              mesh: SequenceParallelMesh) -> tuple[torch.Tensor, ...]:
    """Sequence shards -> this rank's channels over the ring rank's sequence: (xBC [B,n,Cr], dt [B,n,hr], mask)."""
    p = mesh.ulysses_degree
    idx = [_rank_channels(layer, u, p) for u in range(p)]
    chans = torch.stack([c for c, _ in idx]).to(xbc.device)  # [U, Cr]
    heads = torch.stack([h for _, h in idx]).to(xbc.device)  # [U, hr]
    parts = [xbc[:, :, chans], dt[:, :, heads].to(xbc.dtype)]  # [B, s, U, .]
    if mask is not None:
        parts.append(mask[:, :, None, None].to(xbc.dtype).expand(-1, -1, p, 1))
    send = torch.cat(parts, dim=-1)
    got = seq_to_heads(send, mesh.ulysses_group, mesh.stats, device=mesh.comm_device)[:, :, 0]  # [B, n, C']
    cr, hr = chans.shape[1], heads.shape[1]
    out = torch.split(got, [cr, hr] + ([1] if mask is not None else []), dim=-1)
    return out[0], out[1].to(dt.dtype), (out[2][..., 0] if mask is not None else None)


def _piece_fn(layer: torch.nn.Module, prm: SSDParams, hr: int, gl: int) -> Any:
    hd, n = layer.head_dim, layer.ssm_state_size
    scan = layer_function(layer, "mamba2_chunk_scan")

    def piece(y: torch.Tensor, side: tuple[torch.Tensor, ...], carries: bool) -> Any:
        b, length = y.shape[:2]
        if len(side) > 1:  # padding mask: upstream zeroes padded tokens after the conv
            y = (y * side[1][..., None]).to(y.dtype)
        x, bb, cc = torch.split(y, [hr * hd, gl * n, gl * n], dim=-1)
        return ssd_piece(scan, x.reshape(b, length, hr, hd), side[0], bb.reshape(b, length, gl, n),
                         cc.reshape(b, length, gl, n), prm, carries)

    return piece


def sp_mamba2_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                      row_bounds: tuple[tuple[int, ...], ...], mesh: SequenceParallelMesh) -> torch.Tensor:
    """The mixer's forward on this rank's sequence shard [B, S/sp, H] (the mesh's layout) -> [B, S/sp, H]."""
    fns = sys.modules[type(layer).__module__]
    dtype = hidden_states.dtype
    hidden_states = fns.apply_mask_to_padding_states(hidden_states, attention_mask)
    gate, xbc, dt = _in_proj(layer, hidden_states).split([layer.intermediate_size, layer.conv_dim, layer.num_heads],
                                                         dim=-1)
    bsz, s_loc = xbc.shape[:2]
    xbc_h, dt_h, mask_h = _to_heads(layer, xbc, dt, attention_mask, mesh)
    chans, heads = _rank_channels(layer, mesh.ulysses_rank, mesh.ulysses_degree)
    weight = layer.conv1d.weight.squeeze(1)[chans.to(xbc.device)]
    bias = layer.conv1d.bias[chans.to(xbc.device)] if layer.conv1d.bias is not None else None
    hd = heads.to(xbc.device)
    prm = SSDParams(a=-torch.exp(layer.A_log.float())[hd], d=layer.D[hd], dt_bias=layer.dt_bias[hd],
                    dt_limit=tuple(layer.time_step_limit), chunk_size=int(layer.chunk_size))
    hr = heads.numel()
    gl = (chans.numel() - hr * layer.head_dim) // (2 * layer.ssm_state_size)

    conv_fn = layer_function(layer, "causal_conv1d_fn")

    def conv(x: torch.Tensor) -> torch.Tensor:
        return conv_fn(x.transpose(1, 2), weight, bias, activation=layer.activation).transpose(1, 2)

    plan = ring_plan(s_loc * mesh.sp_size, mesh.ring_degree, mesh.ring_rank, mesh.effective_layout, row_bounds)
    side = (dt_h,) if mask_h is None else (dt_h, mask_h)
    out = ring_recurrence(xbc_h, side, plan, mesh, conv, _piece_fn(layer, prm, hr, gl), "scalar",
                          int(layer.conv_kernel_size), mesh.state_passing)  # [B, n, hr, head_dim]
    out = heads_to_seq(out.contiguous(), mesh.ulysses_group, mesh.stats, device=mesh.comm_device)
    out = out.reshape(bsz, s_loc, -1)
    if getattr(layer, "mamba_rms_norm", True):
        out = layer.norm(out, gate)
    else:  # Falcon-H1 without its gated norm: the gate alone, as upstream
        out = out * F.silu(gate)
    return layer.out_proj(out.to(dtype))


def _in_proj(layer: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """in_proj, with Falcon-H1's muP multipliers (on its input, and per channel group on its output) as upstream."""
    mult = getattr(layer, "ssm_in_multiplier", None)
    if mult is not None:
        hidden_states = hidden_states * mult
    out = layer.in_proj(hidden_states)
    mup = getattr(layer, "mup_vector", None)
    return out * mup if mup is not None else out
