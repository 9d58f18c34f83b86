"""Tiled MLP (ALST semantics): each decoder MLP runs over tiles of the local sequence.

    apply_tiled_mlp(model, True)   # tile count from the shapes: ceil(S_local / hidden_size), at least 1
    apply_tiled_mlp(model, 4)      # 4 tiles (at most one per token)

Forward runs each tile through `torch.utils.checkpoint.checkpoint(mlp_forward, tile, use_reentrant=False)`
and concatenates the outputs, so the [tile, intermediate] activations of a tile are dropped as soon as the
tile is done; backward recomputes tile by tile and autograd sums the weight gradients of all tiles. The
peak is one tile's intermediates in forward and in backward, never a [S_local, intermediate] tensor, plus
one full-length input-gradient buffer the tiles write into (`_Tile`).
Under no_grad the tiles simply run one after the other (same peak, nothing to recompute).

Exact: the MLP is per token, so tiling only changes the order of independent rows. It composes with layer
checkpointing (nested non-reentrant checkpoints), LoRA on the MLP projections and FSDP2 (parameters are
gathered per decoder layer, outside the tiles). There is no collective per tile, so tile counts may
differ between ranks (dp ranks with different row lengths) without any risk of a hang. DeepSpeed ZeRO-3 is
the exception: it gathers a projection's parameters at each call, i.e. once per tile, over all ranks, so
every rank must run the same number of tiles; `same_tile_count` makes them (one MAX all-reduce per forward).

The override is instance-level (`mlp.forward`): no module is replaced, state_dict keys are unchanged.
MLPs seqpar does not recognise as per-token dense MLPs (mixture-of-experts blocks, unknown structures)
are refused with a SeqParError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .. import comm
from ..errors import SeqParError
from ..unwrap import decoder_layers

__all__ = ["tile_count_arg", "apply_tiled_mlp", "remove_tiled_mlp", "decoder_mlps", "auto_tile_count", "TiledForward",
           "same_tile_count"]

_REFUSE = "set memory.tiled_mlp: false (or tiled_mlp=False for the Trainer drop-in)"


def auto_tile_count(seq_len: int, hidden_size: int) -> int:
    """ALST's rule: tiles of about hidden_size tokens, so a tile's [tile, intermediate] activation is about
    the size of one MLP weight matrix."""
    return max(1, math.ceil(seq_len / max(1, hidden_size)))


def _is_dense_mlp(mlp: torch.nn.Module) -> bool:
    """Per-token gated MLPs of the supported archs: gate/up/down projections (Phi3: fused gate_up_proj)."""
    has = lambda *names: all(isinstance(getattr(mlp, n, None), torch.nn.Module) for n in names)  # noqa: E731
    routed = any(hasattr(mlp, n) for n in ("experts", "router", "shared_expert"))
    return type(mlp).__name__.endswith("MLP") and not routed and (
        has("gate_proj", "up_proj", "down_proj") or has("gate_up_proj", "down_proj")
    )


def decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MLP module of every decoder layer; SeqParError if one is not a per-token dense MLP."""
    layers = decoder_layers(model)
    if not layers:
        raise SeqParError(f"{type(model).__name__} has no decoder layers seqpar recognises: {_REFUSE}")
    out = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, torch.nn.Module) or not _is_dense_mlp(mlp):
            found = type(mlp).__name__ if mlp is not None else "no `mlp` attribute"
            raise SeqParError(
                f"tiled MLP cannot tile the MLP of {type(layer).__name__} ({found}): it supports per-token dense "
                f"MLPs (gate/up/down projections; mixture-of-experts blocks are not tiled): {_REFUSE}"
            )
        out.append(mlp)
    return out


class TiledForward:
    """The instance-level forward of a tiled MLP: `tiles` = int, or None for auto_tile_count."""

    def __init__(self, orig: torch.nn.Module.forward, tiles: int | None) -> None:
        self.orig = orig
        self.tiles = tiles
        self.exact: int | None = None  # set by same_tile_count: this many tiles, even empty ones

    def count(self, x: torch.Tensor) -> int:
        if self.exact is not None:
            return self.exact
        seq = x.shape[-2] if x.dim() >= 2 else 1
        n = auto_tile_count(seq, x.shape[-1]) if self.tiles is None else self.tiles
        return max(1, min(n, seq))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = self.count(x)
        if n == 1:
            return self.orig(x)
        if not torch.is_grad_enabled():
            return torch.cat([self.orig(t) for t in x.tensor_split(n, dim=-2)], dim=-2)
        sink = _InputGrad(n) if x.requires_grad else None
        outs, lo = [], 0
        for size in _tile_sizes(x.shape[-2], n):  # each tile's view made just before its checkpoint: see _Tile
            t = _Tile.apply(x, sink, lo, size) if sink is not None else x.narrow(-2, lo, size)
            outs.append(checkpoint(self.orig, t, use_reentrant=False))
            lo += size
        return torch.cat(outs, dim=-2)


def _tile_sizes(length: int, n: int) -> list[int]:
    """tensor_split's sizes: the first length % n tiles one longer."""
    q, r = divmod(length, n)
    return [q + 1] * r + [q] * (n - r)


class _InputGrad:
    """The full-length input gradient of one tiled call, filled tile by tile during backward."""

    def __init__(self, n: int) -> None:
        self.n, self.done, self.buf = n, 0, None


class _Tile(torch.autograd.Function):
    """x[..., lo:lo+size, :] whose backward writes the tile's gradient into the call's one full-length buffer.

    Plain slices (tensor_split) make autograd keep every tile's input gradient until all tiles are done and
    then add them through full-length slice_backward buffers (two at once): about 3x the input's bytes at
    the MLP backward's peak. Here each tile's gradient is copied into one buffer as soon as its recompute is
    done (a tile's node runs right after its checkpoint's: it was created just before it), and the last tile
    returns the buffer as the gradient of x (the others return none). Parameters are untouched, so DDP,
    FSDP2 and ZeRO-3 see the same per-tile recomputes as with plain slices."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: _InputGrad, lo: int, size: int) -> torch.Tensor:
        ctx.sink, ctx.lo, ctx.size, ctx.shape = sink, lo, size, x.shape
        return x.narrow(-2, lo, size)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        sink = ctx.sink
        if sink.buf is None:
            sink.buf = g.new_zeros(ctx.shape)
        sink.buf.narrow(-2, ctx.lo, ctx.size).copy_(g)
        sink.done += 1
        if sink.done < sink.n:
            return None, None, None, None
        buf, sink.buf, sink.done = sink.buf, None, 0  # reset: a retain_graph backward runs the tiles again
        return buf, None, None, None


def tile_count_arg(tiles: bool | int | None, what: str, apply_fn: str, remove_fn: str) -> int | None:
    """An apply_tiled_* `tiles` argument: None for True (automatic count), else the int >= 1 it gives."""
    if isinstance(tiles, bool) or tiles is None:
        if not tiles:
            raise SeqParError(f"{apply_fn}(tiles=False): call {remove_fn} instead")
        return None
    n = int(tiles)
    if n < 1:
        raise SeqParError(f"{what} tile count {tiles}: use True (automatic) or an int >= 1")
    return n


def apply_tiled_mlp(model: torch.nn.Module, tiles: bool | int = True) -> int:
    """Tile every decoder MLP of `model` (PEFT wrappers fine; before FSDP2). Returns the number of MLPs tiled.

    tiles: True = auto (ceil(S_local / hidden_size) per forward), an int >= 1 = that many tiles. Applying
    again changes the tile count.
    """
    n = tile_count_arg(tiles, "tiled MLP", "apply_tiled_mlp", "remove_tiled_mlp")
    mlps = decoder_mlps(model)  # every check before any change
    for mlp in mlps:
        cur = mlp.__dict__.get("forward")
        orig = cur.orig if isinstance(cur, TiledForward) else mlp.forward
        mlp.forward = TiledForward(orig, n)
    return len(mlps)


def remove_tiled_mlp(model: torch.nn.Module) -> None:
    for m in _tiled_modules(model):
        del m.forward


def _tiled_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m.__dict__.get("forward"), TiledForward)]


def same_tile_count(model: torch.nn.Module, seq_len: int, hidden_size: int, groups: Sequence[Any],
                    device: torch.device) -> int:
    """From now on every tiled MLP of `model` runs the same number of tiles on every rank: the largest count
    any rank picks for its local length `seq_len` (a rank with a shorter sequence may run empty tiles).
    It stays set until the next call, so a layer recomputed in backward (activation checkpointing) runs
    the tiles its forward ran. A MAX all-reduce over each of `groups` in turn (together: all ranks): call it
    before each forward, at the same point on every rank, with groups no one else is using at that moment
    (seqpar's sp / dp groups: DeepSpeed's own collectives on the world group are not ordered with ours)."""
    fwds = [m.forward for m in _tiled_modules(model)]
    if not fwds:  # the same model on every rank: all skip the all-reduce alike
        return 1
    for f in fwds:
        f.exact = None
    n = max(f.count(torch.empty(1, seq_len, hidden_size, device="meta")) for f in fwds)
    for group in groups:
        n = int(comm.all_reduce_values([n], group, device, op=torch.distributed.ReduceOp.MAX)[0])
    for f in fwds:
        f.exact = n
    return n
