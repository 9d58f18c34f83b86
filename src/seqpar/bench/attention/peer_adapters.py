"""Optional peers of the side-by-side benchmark (`--peers`), each with its local attention pointed at the same CPU
flash kernel seqpar runs (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, via seqpar's CpuFlashKernel).

Neither peer is a seqpar dependency (`pip install seqpar[peers]` brings yunchang; torch's context parallel ships
with torch). What each adapter changes, and nothing more:

- yunchang (the USP paper's library). Its local attention defaults to flash_attn (CUDA only):
  * Ulysses (`UlyssesAttention`): its `attn_fn` (flash_attn_func: q, k, v [B, S, H, D] -> out, saving q, k, v, out,
    lse for backward) is replaced by `cpu_flash_attn_func`, the same contract on the CPU kernel.
  * ring (`zigzag_ring_flash_attn_func`) and USP (`LongContextAttention`, ring_impl_type "zigzag"): its forward-only
    and backward-only kernel entries (`yunchang.kernels.flash_attn_forward` / `flash_attn_backward`: out and
    lse [B, H, S]; gradients written into the caller's buffers) are replaced by `cpu_flash_forward` /
    `cpu_flash_backward` while the call runs (`yunchang_on_cpu`, around forward and backward). The backward
    writes the kernel's gradients into yunchang's buffers with one copy (flash_attn writes them there directly),
    so one kernel call's gradients exist twice for a moment.
  * fp32: yunchang's ring backward takes `dq = dq_buffer.to(torch.float32)` as its accumulator, which in fp32 is
    the kernel's output buffer itself, so the next kernel call overwrites the sum (flash_attn never runs fp32).
    `UpcastCopies` restores what that line does for bf16 / fp16 inputs (a copy) while yunchang's ring runs.
- torch context parallel (torchtitan's; torch.distributed.tensor.experimental). Its ring attention dispatches only
  the CUDA SDPA ops (there is no sharding rule for the CPU flash op), so the adapter calls its ring functions
  (`_templated_ring_attention` / `_templated_ring_attention_backward`, round-robin load balance = zigzag shards)
  with the CPU kernel as the op, in one autograd Function, for both rotate methods (all-gather, all-to-all).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...attention.kernels import CpuFlashKernel, default_scale

__all__ = ["yunchang_available", "peer_versions", "cpu_flash_attn_func", "cpu_flash_forward", "cpu_flash_backward",
           "UpcastCopies", "yunchang_on_cpu", "yunchang_ulysses", "yunchang_ring", "yunchang_usp", "torch_cp_ring"]

_KERNEL = CpuFlashKernel()


def yunchang_available() -> bool:
    return importlib.util.find_spec("yunchang") is not None


def peer_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        yc = version("yunchang")
    except PackageNotFoundError:
        yc = None
    return {"yunchang": yc, "torch_context_parallel": torch.__version__}


class _CpuFlashAttn(torch.autograd.Function):
    """flash_attn_func's contract on the CPU kernel: saves q, k, v, out, lse (as flash_attn does)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        out, lse = _KERNEL.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (scale, causal)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal = ctx.args
        return (*_KERNEL.backward(dout, q, k, v, out, lse, causal, scale), None, None)


def cpu_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, *args: Any, **kwargs: Any):
    """Drop-in for flash_attn_func (yunchang's Ulysses `attn_fn`): q [B, S, Hq, D], k/v [B, S, Hkv, D] -> out."""
    if dropout_p:
        raise ValueError("the CPU adapter runs without dropout")
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    return _CpuFlashAttn.apply(q, k, v, scale, causal)


def cpu_flash_forward(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, *args: Any, **kwargs: Any):
    """Drop-in for yunchang.kernels.flash_attn_forward: -> (out [B, S, H, D], lse [B, H, S] fp32)."""
    scale = default_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    out, lse = _KERNEL.forward(q, k, v, causal, scale)
    return out, lse.transpose(1, 2)


def cpu_flash_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, *args: Any,
                       **kwargs: Any) -> None:
    """Drop-in for yunchang.kernels.flash_attn_backward: the gradients written into dq, dk, dv (lse [B, H, S])."""
    g = _KERNEL.backward(dout, q, k, v, out, lse.transpose(1, 2), causal, softmax_scale)
    for buf, t in zip((dq, dk, dv), g):
        _KERNEL_BUFFERS.add(buf.untyped_storage().data_ptr())
        buf.copy_(t)


_KERNEL_BUFFERS: set[int] = set()  # storages the backward kernel writes into (while a yunchang call runs)


class UpcastCopies(TorchFunctionMode):
    """`buf.to(torch.float32)` of an fp32 buffer the backward kernel writes into returns a copy, as it does for
    bf16 / fp16 inputs (module docstring: yunchang's ring takes that result as an accumulator; without the copy
    the next kernel call overwrites it). Every other call is left alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.Tensor.to and len(args) == 2 and args[1] is torch.float32 and not kwargs
                and args[0].dtype == torch.float32 and args[0].untyped_storage().data_ptr() in _KERNEL_BUFFERS):
            return args[0].clone()
        return func(*args, **kwargs)


def _upcast_copies(fn):
    def wrapped(*args, **kwargs):
        with UpcastCopies():  # entered inside: autograd runs a backward without the caller's function modes
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def yunchang_on_cpu() -> Iterator[None]:
    """yunchang's forward-only / backward-only kernel entries on the CPU kernel, and its ring backwards under
    `UpcastCopies`: wrap a ring or USP call's forward AND backward (and a checkpointed recompute) in it."""
    import yunchang.kernels as yk
    import yunchang.ring.ring_flash_attn as rf
    import yunchang.ring.zigzag_ring_flash_attn as zz

    saved = (yk.flash_attn_forward, yk.flash_attn_backward, zz.zigzag_ring_flash_attn_backward,
             rf.ring_flash_attn_backward)
    yk.flash_attn_forward, yk.flash_attn_backward = cpu_flash_forward, cpu_flash_backward
    zz.zigzag_ring_flash_attn_backward = _upcast_copies(saved[2])
    rf.ring_flash_attn_backward = _upcast_copies(saved[3])
    try:
        yield
    finally:
        yk.flash_attn_forward, yk.flash_attn_backward, zz.zigzag_ring_flash_attn_backward = saved[:3]
        rf.ring_flash_attn_backward = saved[3]
        _KERNEL_BUFFERS.clear()


def yunchang_ulysses(group: Any, scale: float):
    """yunchang's UlyssesAttention on `group` with the CPU kernel as its local attention: (q, k, v) -> out."""
    from yunchang import UlyssesAttention
    from yunchang.kernels import AttnType

    # its default attn_type (FA) asserts flash_attn at construction; TORCH_FLASH constructs, then attn_fn is replaced
    layer = UlyssesAttention(group, attn_type=AttnType.TORCH_FLASH)
    layer.attn_fn = cpu_flash_attn_func
    return lambda q, k, v: layer(q, k, v, softmax_scale=scale, causal=True)


def yunchang_ring(group: Any, scale: float):
    """yunchang's zigzag ring (zigzag_ring_flash_attn_func) on `group`, kernels on the CPU one."""
    from yunchang.ring import zigzag_ring_flash_attn_func

    return lambda q, k, v: zigzag_ring_flash_attn_func(q, k, v, softmax_scale=scale, causal=True, group=group)


def yunchang_usp(ulysses_group: Any, ring_group: Any, scale: float):
    """yunchang's LongContextAttention (Ulysses over `ulysses_group`, zigzag ring over `ring_group`), CPU kernel."""
    from yunchang import LongContextAttention
    from yunchang.globals import PROCESS_GROUP

    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = ulysses_group, ring_group  # read by the constructor
    layer = LongContextAttention(ring_impl_type="zigzag")

    return lambda q, k, v: layer(q, k, v, softmax_scale=scale, causal=True)


def _cp_forward_op(query, key, value, is_causal, scale, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                      attn_mask=None, scale=scale)


def _cp_backward_op(query, key, value, out, logsumexp, is_causal, grad_out, scale, **kwargs):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=None, scale=scale)


class _TorchCpRing(torch.autograd.Function):
    """torch context parallel's ring attention (load-balanced) with the CPU op; [B, H, S, D] inside, as torch's
    SDPA path has it."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, method):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        with _cp_rotate(method):
            out, lse = cp._templated_ring_attention(group, 2, _cp_forward_op, q.transpose(1, 2), k.transpose(1, 2),
                                                    v.transpose(1, 2), is_causal=True, scale=scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, scale, method)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        q, k, v, out, lse = ctx.saved_tensors
        group, scale, method = ctx.args
        with _cp_rotate(method):
            dq, dk, dv = cp._templated_ring_attention_backward(
                group, 2, _cp_backward_op, grad_out=dout.transpose(1, 2), grad_out_name="grad_out",
                query=q.transpose(1, 2), key=k.transpose(1, 2), value=v.transpose(1, 2), out=out, logsumexp=lse,
                is_causal=True, scale=scale)[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None


@contextlib.contextmanager
def _cp_rotate(method: str) -> Iterator[None]:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    opts = cp._cp_options
    saved = opts.rotate_method, opts.enable_load_balance
    opts.rotate_method = cp._RotateMethod.ALL_GATHER if method == "allgather" else cp._RotateMethod.ALL_TO_ALL
    opts.enable_load_balance = True
    try:
        yield
    finally:
        opts.rotate_method, opts.enable_load_balance = saved


def torch_cp_ring(group: Any, scale: float, method: str):
    """torch context parallel's ring on `group` (method 'allgather' | 'alltoall'): (q, k, v) [B, S, H, D] -> out.
    Its shards are round-robin halves (head and tail chunk), the same as seqpar's zigzag layout; q, k, v must have
    the same head count (its ring has no GQA)."""
    return lambda q, k, v: _TorchCpRing.apply(q, k, v, group, scale, method)
