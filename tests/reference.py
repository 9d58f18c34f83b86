"""Independent single-process references for the tests (plain float64 math on the full sequence)."""

from __future__ import annotations

import torch


def doc_ids(seq_len: int, cu_seqlens) -> torch.Tensor:
    ids = torch.zeros(seq_len, dtype=torch.long)
    if cu_seqlens is not None:
        for b in list(cu_seqlens)[1:-1]:
            ids[int(b):] += 1
    return ids


def reference_attention(q, k, v, causal: bool, cu_seqlens=None, scale=None) -> torch.Tensor:
    """Softmax attention in float64 with an explicit boolean mask; GQA by repeating KV heads."""
    q, k, v = (t.double() for t in (q, k, v))
    b, s, h, d = q.shape
    g = h // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d**-0.5 if scale is None else scale)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    ids = doc_ids(s, cu_seqlens)
    allowed = allowed & (ids[:, None] == ids[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


class AdapterOff:
    """The reference model of a LoRA policy: the same PEFT model called with its adapter disabled."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kw):
        with self.model.disable_adapter():
            return self.model(**kw)
