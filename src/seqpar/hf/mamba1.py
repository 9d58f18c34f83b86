"""Sequence-parallel Mamba1 (selective scan) mixers: Jamba (`JambaMambaMixer`), Falcon-Mamba, Mamba.

The mixer (transformers 5.24): in_proj -> [x | z] -> depthwise causal Conv1d over x (+ silu) -> x_proj(x) ->
[dt | B | C] (Jamba, Falcon-Mamba: RMS norms on each) -> dt_proj's weight on dt -> selective scan per channel
(`mamba_selective_scan`: A = -exp(A_log) [d, n], dt = softplus(dt + dt_proj.bias), D skip, output times silu(z))
-> out_proj. The conv and the scan look along the sequence, per channel; x_proj mixes the channels per token.

- Ulysses: one all-to-all moves x and z to a slice of the channels over the ring rank's sequence (the Ulysses
  degree must divide intermediate_size). The conv runs on that slice; x_proj is a sum over channels, so each rank
  applies its columns of x_proj.weight (and of a LoRA adapter's A) and a sum all-reduce over the Ulysses group
  gives every rank the whole [dt | B | C] (dt_rank + 2 n numbers per token); dt_proj, A_log, D, conv1d run with
  the rank's rows (differentiable slices of the layer's parameters). A second all-to-all returns the scan output
  for out_proj.
- Ring / USP: the conv gets its halo (seqpar.recurrent.ring_conv), the scan its incoming state by state passing
  (recurrent.selective: one decay per channel and state entry, a "diagonal" transition).

The conv and the scan are the functions the mixer's own forward calls (hf.layer_kernels: `causal_conv1d_fn`,
`mamba_selective_scan`: the torch paths or causal-conv1d / mamba_ssm). A 2-D padding mask zeroes padded tokens
before in_proj and after the conv, as upstream.
"""

from __future__ import annotations

import sys

import torch

from .. import comm
from ..attention.ulysses import heads_to_seq, seq_to_heads
from ..errors import SeqParError
from ..mesh import SequenceParallelMesh, check_ulysses_divides
from ..recurrent import SelectiveParams, ring_conv, ring_recurrence, selective_piece
from .layer_kernels import layer_function
from .linear_attention import head_space_plan

__all__ = ["MAMBA1_CLASSES", "check_mamba1", "sp_mamba1_forward"]

MAMBA1_CLASSES = ("JambaMambaMixer", "FalconMambaMixer", "MambaMixer")


def check_mamba1(layers: list[torch.nn.Module], mesh: SequenceParallelMesh) -> None:
    """Raise SeqParError (same on every rank: config and mesh only) if SP cannot run these mixers."""
    for layer in layers:
        check_ulysses_divides(mesh, int(layer.intermediate_size), type(layer).__name__, "channels (intermediate_size)")
        if getattr(layer.config, "_is_quantized", False):
            raise SeqParError(f"{type(layer).__name__}: quantized Mamba mixers are not supported under SP")


def _to_heads(x: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None,
              mesh: SequenceParallelMesh) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[B, s, d] sequence shards -> this rank's d / U channels of x and z (and the mask) over the ring rank's
    sequence."""
    bsz, s, d = x.shape
    u = mesh.ulysses_degree
    parts = [x.reshape(bsz, s, u, d // u), z.reshape(bsz, s, u, d // u)]
    if mask is not None:
        parts.append(mask[:, :, None, None].to(x.dtype).expand(-1, -1, u, 1))
    got = seq_to_heads(torch.cat(parts, dim=-1), mesh.ulysses_group, mesh.stats, device=mesh.comm_device)[:, :, 0]
    return got[..., : d // u], got[..., d // u : 2 * d // u], (got[..., -1] if mask is not None else None)


def _norm(layer: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    norm = getattr(layer, name, None)  # Jamba / Falcon-Mamba normalise dt, B, C; Mamba does not
    return norm(t) if norm is not None else t


def _x_proj_share(lin: torch.nn.Module, x: torch.Tensor, cols: slice, u: int) -> torch.Tensor:
    """x_proj on this rank's channels `cols` of x: its share of x_proj(full x) (the Ulysses sum gives the rest). At
    U = 1 the module itself (any wrapper); at U > 1 a bias-free Linear's columns, or PEFT's LoRA Linear: base and
    B A x are both linear in x's channels, so each takes the columns (upstream's torch path calls the module:
    LoRA on x_proj trains)."""
    if u == 1:
        return lin(x)
    base = getattr(lin, "base_layer", lin)
    lora = base is not lin and hasattr(lin, "lora_A")
    if not isinstance(base, torch.nn.Linear) or base.bias is not None or (base is not lin and not lora):
        raise SeqParError(f"x_proj is {type(lin).__name__}: under Ulysses seqpar splits a bias-free Linear (or PEFT "
                          "LoRA on one) over the channels; use a ring (ulysses_degree 1) or leave x_proj unwrapped")
    out = x @ base.weight[:, cols].t()
    if not lora or lin.disable_adapters or lin.merged:
        return out
    for name in lin.active_adapters:
        if name not in lin.lora_A:
            continue
        a, b = lin.lora_A[name], lin.lora_B[name]
        if name in getattr(lin, "lora_variant", {}) or b.bias is not None:
            raise SeqParError(f"x_proj's adapter {name!r} is not plain LoRA (DoRA or another variant, or a LoRA bias): "
                              "under Ulysses seqpar splits plain LoRA only; use a ring (ulysses_degree 1)")
        h = lin.lora_dropout[name](x.to(a.weight.dtype)) @ a.weight[:, cols].t()
        out = out + b(h) * lin.scaling[name]
    return out.to(x.dtype)


def sp_mamba1_forward(layer: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                      row_bounds: tuple[tuple[int, ...], ...], mesh: SequenceParallelMesh) -> torch.Tensor:
    """The mixer's forward on this rank's sequence shard [B, S/sp, H] (the mesh's layout) -> [B, S/sp, H]."""
    fns = sys.modules[type(layer).__module__]
    dtype = hidden_states.dtype
    hidden_states = fns.apply_mask_to_padding_states(hidden_states, attention_mask)
    x, z = layer.in_proj(hidden_states).chunk(2, dim=-1)
    bsz, s_loc, d = x.shape
    x, z, mask = _to_heads(x, z, attention_mask, mesh)
    u, rank = mesh.ulysses_degree, mesh.ulysses_rank
    mine = slice(rank * d // u, (rank + 1) * d // u)
    weight = layer.conv1d.weight.squeeze(1)[mine]
    bias = layer.conv1d.bias[mine] if layer.conv1d.bias is not None else None
    conv_fn = layer_function(layer, "causal_conv1d_fn")

    def conv(t: torch.Tensor) -> torch.Tensor:
        return conv_fn(t.transpose(1, 2), weight, bias, activation=layer.activation).transpose(1, 2)

    plan = head_space_plan(mesh, s_loc * mesh.sp_size, row_bounds)
    x = ring_conv(x, plan, mesh, conv, int(layer.conv_kernel_size))
    if mask is not None:
        x = (x * mask[..., None]).to(x.dtype)
    proj = _x_proj_share(layer.x_proj, x, mine, u)
    if u > 1:
        proj = comm.all_reduce(proj, mesh.ulysses_group, mesh.stats, device=mesh.comm_device)
    n, r = layer.ssm_state_size, layer.time_step_rank
    ts, b, c = torch.split(proj, [r, n, n], dim=-1)
    ts, b, c = _norm(layer, "dt_layernorm", ts), _norm(layer, "b_layernorm", b), _norm(layer, "c_layernorm", c)
    dt = ts @ layer.dt_proj.weight[mine].t()  # upstream: dt_proj.weight @ dt; its bias goes to the scan
    dt_bias = layer.dt_proj.bias[mine].float() if layer.dt_proj.bias is not None else None
    prm = SelectiveParams(a=-torch.exp(layer.A_log[mine].float()), d=layer.D[mine].float(), dt_bias=dt_bias,
                          scan_kwargs={"use_mambapy": layer.use_mambapy,
                                       "use_associative_scan": getattr(layer, "use_associative_scan", False)})
    scan = layer_function(layer, "mamba_selective_scan")

    def piece(y: torch.Tensor, side: tuple[torch.Tensor, ...], carries: bool):
        return selective_piece(scan, y, *side, prm, carries)

    out = ring_recurrence(x, (dt, b, c, z), plan, mesh, lambda t: t, piece, "diagonal", 1, mesh.state_passing)
    out = heads_to_seq(out[:, :, None].contiguous(), mesh.ulysses_group, mesh.stats, device=mesh.comm_device)
    return layer.out_proj(out.reshape(bsz, s_loc, d).to(dtype))
