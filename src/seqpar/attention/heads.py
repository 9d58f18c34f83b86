"""Head-chunked local attention: a kernel wrapper that runs every call over groups of heads, one after another.

Heads are independent, so splitting a call's KV heads (with the q heads of their GQA groups) into `chunks`
near-equal groups and running the inner kernel on each is exact for any chunk count. What it buys on a GPU:
the CUDA kernels' backward workspace (FlashAttention-2's / cuDNN's fp32 dQ accumulator, dK/dV at the q heads
before the GQA sum: 32 KiB per token for Llama-8B's 32/8 heads of 128) exists for one chunk at a time. What it
costs: the chunk's kernel outputs are copied into the full out / dq / dk / dv (1/chunks of them alive at once
beside the full tensors) and `chunks` launches per call. Every SP mode gets it through the kernel it calls
(seqpar.attention(..., head_chunks=c); `memory.attention_head_chunks` in seqpar train), so a world of 1, each
Ulysses rank and each ring step run their kernels per head chunk. The idea is UPipe's ("untied Ulysses").
"""

from __future__ import annotations

import torch

from .kernels import AttentionKernel, acc_dtype

__all__ = ["HeadChunked", "head_chunks"]


def head_chunks(num_heads: int, num_kv_heads: int, chunks: int) -> list[tuple[int, int, int, int]]:
    """[(q0, q1, k0, k1)]: up to as many chunks as KV heads, near-equal groups of KV heads, each with the q heads
    of its GQA groups (q head j uses kv head j // (num_heads // num_kv_heads)); past that, each KV head's group of
    q heads split into near-equal parts (at most one q head each), so a KV head is in several chunks."""
    g = num_heads // num_kv_heads
    if chunks <= num_kv_heads:
        n = max(1, chunks)
        cuts = [i * num_kv_heads // n for i in range(n + 1)]
        return [(a * g, b * g, a, b) for a, b in zip(cuts, cuts[1:])]
    s = min(g, -(-chunks // num_kv_heads))
    inner = [i * g // s for i in range(s + 1)]
    return [(kv * g + a, kv * g + b, kv, kv + 1) for kv in range(num_kv_heads) for a, b in zip(inner, inner[1:])]


class HeadChunked:
    """`inner` run per head chunk (forward, backward and, where `inner` has one, the varlen form)."""

    def __init__(self, inner: AttentionKernel, chunks: int):
        self.inner, self.chunks = inner, chunks
        self.name = f"{inner.name}/{chunks} head chunks"
        self.varlen = getattr(inner, "varlen", False)
        self.native_window = getattr(inner, "native_window", False)

    def _parts(self, q: torch.Tensor, k: torch.Tensor, head_dim: int):
        return head_chunks(q.shape[head_dim], k.shape[head_dim], self.chunks)

    def _run_forward(self, fn, q, k, v, head_dim: int, *args):
        if len(self._parts(q, k, head_dim)) == 1:  # one group (a single KV head here): the kernel as it is
            return fn(q, k, v, *args)
        out, lse = q.new_empty(q.shape), None  # [B, S, H, D] rows: the layout every kernel's backward takes
        for q0, q1, k0, k1 in self._parts(q, k, head_dim):
            sq, sk = _heads(head_dim, q0, q1), _heads(head_dim, k0, k1)
            o, l_ = fn(q[sq], k[sk], v[sk], *args)
            if lse is None:
                lse = o.new_empty(q.shape[:-1], dtype=l_.dtype)
            out[sq], lse[sq] = o, l_
            del o, l_  # one chunk's kernel outputs at a time
        return out, lse

    def _run_backward(self, fn, dout, q, k, v, out, lse, head_dim: int, *args):
        parts = self._parts(q, k, head_dim)
        if len(parts) == 1:
            return fn(dout, q, k, v, out, lse, *args)
        # q-head splits of one KV head's group add up their dK / dV parts: in the accumulation dtype (fp32 for half
        # inputs), cast once at the end, as the ring adds its blocks' parts
        split = len({(k0, k1) for _, _, k0, k1 in parts}) < len(parts)
        acc = acc_dtype(k.dtype) if split else k.dtype
        dq = torch.empty_like(q)
        dk, dv = torch.empty_like(k, dtype=acc), torch.empty_like(v, dtype=acc)
        done = set()  # KV heads whose gradient holds a first part
        for q0, q1, k0, k1 in parts:
            sq, sk = _heads(head_dim, q0, q1), _heads(head_dim, k0, k1)
            g = fn(dout[sq], q[sq], k[sk], v[sk], out[sq], lse[sq], *args)
            dq[sq] = g[0]
            if (k0, k1) in done:
                dk[sk] += g[1]
                dv[sk] += g[2]
            else:
                dk[sk], dv[sk] = g[1], g[2]
                done.add((k0, k1))
            del g
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    def forward(self, q, k, v, causal, scale, band=None):
        if band is None:  # a kernel object without the band keyword still runs unwindowed calls
            return self._run_forward(self.inner.forward, q, k, v, 2, causal, scale)
        return self._run_forward(self.inner.forward, q, k, v, 2, causal, scale, band)

    def backward(self, dout, q, k, v, out, lse, causal, scale, band=None):
        if band is None:
            return self._run_backward(self.inner.backward, dout, q, k, v, out, lse, 2, causal, scale)
        return self._run_backward(self.inner.backward, dout, q, k, v, out, lse, 2, causal, scale, band)

    def varlen_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return self._run_forward(self.inner.varlen_forward, q, k, v, 1, cu_q, cu_k, max_q, max_k, causal, scale)

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        return self._run_backward(self.inner.varlen_backward, dout, q, k, v, out, lse, 1, cu_q, cu_k, max_q, max_k,
                                  causal, scale)


def _heads(dim: int, a: int, b: int) -> tuple:
    """An index selecting heads [a, b) along `dim` (2 for [B, S, H, D] and [B, S, H]; 1 for varlen [T, H, D])."""
    return (slice(None),) * dim + (slice(a, b),)
