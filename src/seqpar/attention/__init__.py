"""seqpar.attention(q, k, v, mesh, ...): exact attention over a sequence split across the SP group."""

from __future__ import annotations

import sys
import types

import torch

from ..errors import SeqParError
from ..layout import check_length
from ..mesh import SequenceParallelMesh
from .heads import HeadChunked
from .kernels import AttentionKernel, default_scale, get_kernel
from .ulysses import head_plan
from .usp import usp_attention

__all__ = ["attention", "validate_cu_seqlens"]


def validate_cu_seqlens(cu_seqlens, seq_len: int) -> list[int]:
    """Check packed-document boundaries; return the inner boundaries (without 0 and seq_len)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
            raise SeqParError(
                f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = [int(x) for x in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len:
        raise SeqParError(
            f"cu_seqlens must start at 0 and end at the FULL (padded) sequence length {seq_len}, got "
            f"{cu[:3]}...{cu[-2:]}: they describe the full sequence, not this rank's shard; count padding as "
            "its own last document"
        )
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise SeqParError("cu_seqlens must be non-decreasing")
    return sorted({b for b in cu[1:-1] if 0 < b < seq_len})


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: SequenceParallelMesh,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    kernel: str | AttentionKernel = "auto",
    overlap_chunks: int = 1,
    head_chunks: int = 1,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact softmax attention for sequence-parallel inputs.

    q: [B, S_local, Hq, D]; k: [B, S_local, Hkv, D] (Hq % Hkv == 0); v: [B, S_local, Hkv, Dv], each this rank's
    shard made by `seqpar.shard`. Returns [B, S_local, Hq, Dv] in q's dtype, differentiable w.r.t. q, k, v. A v head
    dim other than q/k's (MLA) is padded with zeros to the larger of the two (what every kernel and exchange
    takes; the logits and the output's first Dv columns are unchanged) and the output cut back.
    cu_seqlens: packed-document boundaries in the FULL sequence, the same for every row of the batch; attention
    never crosses them.
    Mode (Ulysses / ring / USP) and layout come from the mesh. Accumulation is fp32 (fp64 for fp64).
    kernel: 'auto' (attention.kernel_choice), a kernel name ('flash', 'cudnn', 'efficient', 'cpu', 'math'), or
    an AttentionKernel object.
    overlap_chunks: pure Ulysses only: exchange the local kv heads in this many chunks so that chunk c's
    kernel overlaps the other chunks' all-to-alls (exact for any value; must divide the local kv heads).
    head_chunks: run every local kernel call over this many groups of kv heads (with their q heads), one after
    another (attention.heads): exact for any value; on a GPU the kernels' backward workspace exists for one
    group at a time. 1 = whole calls.
    window: a causal sliding window: query i sees keys i - window + 1 .. i (transformers' `sliding_window`);
    blocks out of reach are not computed (attention.pieces). None = full causal attention.
    sinks: [Hq] attention-sink logits (gpt-oss): one more term per head in every row's softmax denominator,
    differentiable (attention.sinks). None = no sinks.
    All checks run before any communication, so bad input raises SeqParError on every rank.
    """
    _check_qkv(q, k, v)
    b, s, hq, d = q.shape
    seq_len = s * mesh.sp_size
    check_length(seq_len, mesh)
    bounds = None
    if cu_seqlens is not None:  # the same boundaries in every row (B > 1: e.g. Llama 4's attention chunks)
        bounds = validate_cu_seqlens(cu_seqlens, seq_len)
    _check_chunks(overlap_chunks, q.shape[2], k.shape[2], mesh)
    _check_window(window, causal)
    _check_sinks(sinks, hq, q)
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    dv = v.shape[3]
    if dv != d:  # MLA: one head dim for every kernel and exchange, zeros where a tensor had none
        width = max(d, dv)
        q, k, v = (torch.nn.functional.pad(t, (0, width - t.shape[3])) for t in (q, k, v))
        d = width
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))  # torch refuses more backwards
    kern = get_kernel(q.device, kernel, q.dtype, head_dim=d, training=training)
    if not isinstance(head_chunks, int) or head_chunks < 1:
        raise SeqParError(f"head_chunks must be an int >= 1, got {head_chunks!r}")
    if head_chunks > 1:
        kern = HeadChunked(kern, head_chunks)
    out = usp_attention(q, k, v, mesh, seq_len, causal, scale, kern, bounds, overlap_chunks, window, sinks)
    return out if out.shape[3] == dv else out[..., :dv]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise SeqParError(f"q, k, v must be [B, S_local, H, D]; got {shapes}")
    if k.shape[:3] != v.shape[:3]:
        raise SeqParError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, length and heads")
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise SeqParError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in batch, length or head_dim")
    if hq % k.shape[2] != 0:
        raise SeqParError(f"num q heads {hq} must be a multiple of num kv heads {k.shape[2]} (GQA)")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise SeqParError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_window(window: int | None, causal: bool) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise SeqParError(f"window must be a positive int (tokens a query sees, itself included), got {window!r}")
    if not causal:
        raise SeqParError("window= needs causal=True: seqpar's sliding window is transformers' causal one")


def _check_sinks(sinks: torch.Tensor | None, hq: int, q: torch.Tensor) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,) or not sinks.dtype.is_floating_point:
        what = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise SeqParError(f"sinks must be a floating tensor of shape [{hq}] (one logit per q head), got {what}")
    if sinks.device != q.device:
        raise SeqParError(f"sinks are on {sinks.device} but q on {q.device}: move them to q's device")


def _check_chunks(chunks: int, hq: int, hkv: int, mesh: SequenceParallelMesh) -> None:
    """overlap_chunks must split the local kv heads of pure Ulysses evenly (checked before any collective)."""
    if chunks == 1:
        return
    local_kv = head_plan(hq, hkv, mesh.ulysses_degree).expanded_kv_heads // mesh.ulysses_degree
    if mesh.ulysses_degree == 1 or mesh.ring_degree != 1 or chunks < 1 or local_kv % chunks:
        raise SeqParError(
            f"overlap_chunks={chunks} needs pure Ulysses (ring_degree 1, got {mesh.ring_degree}, ulysses_degree "
            f"{mesh.ulysses_degree}) and must divide the {local_kv} kv heads each rank holds: use 1 or a divisor"
        )


class _CallableModule(types.ModuleType):
    """`seqpar.attention` is both this package and the function: `seqpar.attention(q, k, v, mesh)` calls it, and
    `import seqpar.attention.kernel_choice as kc` still finds the submodule (a plain function attribute named
    `attention` on the seqpar package would shadow the package for every `import seqpar.attention.<x> as y`)."""

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return attention(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
