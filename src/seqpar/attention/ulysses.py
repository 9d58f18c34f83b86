"""Ulysses: all-to-all between sequence shards and head shards, GQA-correct.

Head plan. `extra` all-zero dummy kv groups may be appended, then each kv head is replicated `rep`
times and its group of G = Hq/Hkv query heads is split over the replicas, padded with zero "dummy"
query heads to `g = ceil(G/rep)` per replica, so that the degree P divides (Hkv+extra)*rep. Rank i
then receives kv heads [i*Hkv'/P, (i+1)*Hkv'/P) and exactly the query heads that use them: local q
head j maps to local kv head j // g, so GQA stays correct (padding q and kv independently, as
360-LLaMA-Factory does, breaks that mapping). Dummy heads attend to zeros and are dropped after.
Examples: Hq=14, Hkv=2, P=4 -> rep=2, g=4: 16 q (2 dummies) / 4 kv, 1 kv + 4 q per rank;
Hq=Hkv=6, P=4 -> extra=2: 8 q / 8 kv; Hq=9, Hkv=3, P=2 -> extra=1, g=3: 12 q / 4 kv.
(extra, rep) minimise the bytes moved per token (2*Hq' + 2*Hkv' heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import comm

__all__ = ["HeadPlan", "head_plan", "pad_heads", "unpad_heads", "seq_to_heads", "heads_to_seq"]


@dataclass(frozen=True)
class HeadPlan:
    num_heads: int
    num_kv_heads: int
    degree: int
    rep: int  # replicas per kv head
    group: int  # query heads per (replicated) kv head, dummies included
    q_src: tuple[int, ...]  # padded q head -> source q head, or -1 for a dummy
    kv_src: tuple[int, ...]  # expanded kv head -> source kv head, or -1 for a dummy (zero) kv head

    @property
    def padded_heads(self) -> int:
        return len(self.q_src)

    @property
    def expanded_kv_heads(self) -> int:
        return len(self.kv_src)

    @property
    def is_identity(self) -> bool:
        return len(self.q_src) == self.num_heads and len(self.kv_src) == self.num_kv_heads

    @property
    def dummy_heads(self) -> int:
        return self.q_src.count(-1)


@lru_cache(maxsize=256)
def head_plan(num_heads: int, num_kv_heads: int, degree: int) -> HeadPlan:
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    g0 = num_heads // num_kv_heads
    best = None
    for extra in range(degree):  # dummy kv groups
        groups = num_kv_heads + extra
        rep0 = degree // math.gcd(degree, groups)
        for rep in range(rep0, rep0 * g0 + 1, rep0):
            g = -(-g0 // rep)
            cost = 2 * groups * rep * g + 2 * groups * rep
            if best is None or cost < best[0]:
                best = (cost, extra, rep, g)
    _, extra, rep, g = best
    q_src, kv_src = [], []
    for kv in range(num_kv_heads + extra):
        real = kv < num_kv_heads
        for r in range(rep):
            kv_src.append(kv if real else -1)
            for w in range(g):
                within = r * g + w
                q_src.append(kv * g0 + within if real and within < g0 else -1)
    return HeadPlan(num_heads, num_kv_heads, degree, rep, g, tuple(q_src), tuple(kv_src))


def _pad_index(src: tuple[int, ...], n: int, device) -> torch.Tensor:
    """Gather index into a tensor extended by one zero head at position n (-1 = dummy)."""
    return torch.tensor([h if h >= 0 else n for h in src], device=device)


def _with_zero_head(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], 1, x.shape[3])], dim=2)


def pad_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: HeadPlan):
    """[B,S,Hq,D],[B,S,Hkv,D] -> padded q [B,S,Hq',D] and expanded k, v [B,S,Hkv',D] (differentiable)."""
    if plan.is_identity:
        return q, k, v
    q_idx = _pad_index(plan.q_src, plan.num_heads, q.device)
    kv_idx = _pad_index(plan.kv_src, plan.num_kv_heads, q.device)
    if -1 in plan.kv_src:
        k, v = _with_zero_head(k), _with_zero_head(v)
    return _with_zero_head(q).index_select(2, q_idx), k.index_select(2, kv_idx), v.index_select(2, kv_idx)


def unpad_heads(out: torch.Tensor, plan: HeadPlan) -> torch.Tensor:
    """Drop dummy heads: [B,S,Hq',D] -> [B,S,Hq,D] in the original head order."""
    if plan.is_identity:
        return out
    keep = [0] * plan.num_heads
    for i, h in enumerate(plan.q_src):
        if h >= 0:
            keep[h] = i
    return out.index_select(2, torch.tensor(keep, device=out.device))


def seq_to_heads(x: torch.Tensor, group, stats=None, device: torch.device | None = None) -> torch.Tensor:
    """[B, S/P, H, D] sequence shard -> [B, S, H/P, D] head shard (ranks' pieces in rank order)."""
    return comm.all_to_all(x, group, scatter_dim=2, gather_dim=1, stats=stats, channel="ulysses", device=device)


def heads_to_seq(x: torch.Tensor, group, stats=None, device: torch.device | None = None) -> torch.Tensor:
    """Inverse of seq_to_heads."""
    return comm.all_to_all(x, group, scatter_dim=1, gather_dim=2, stats=stats, channel="ulysses", device=device)
