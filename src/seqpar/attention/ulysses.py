"""Ulysses: all-to-all between sequence shards and head shards, GQA-correct.

Head plan. `extra` all-zero dummy kv groups may be appended, then each kv head is replicated `rep`
times and its group of G = Hq/Hkv query heads is split over the replicas, padded with zero "dummy"
query heads to `g = ceil(G/rep)` per replica, so that the degree P divides (Hkv+extra)*rep. Rank i
then receives kv heads [i*Hkv'/P, (i+1)*Hkv'/P) and exactly the query heads that use them: local q
head j maps to local kv head j // g, so GQA stays correct (padding q and kv independently, as
360-LLaMA-Factory does, breaks that mapping). Dummy heads attend to zeros and are dropped after.
Examples: Hq=14, Hkv=2, P=4 -> rep=2, g=4: 16 q (2 dummies) / 4 kv, 1 kv + 4 q per rank;
Hq=Hkv=6, P=4 -> extra=2: 8 q / 8 kv; Hq=9, Hkv=3, P=2 -> extra=1, g=3: 12 q / 4 kv.
(extra, rep) minimise the bytes moved per token (2*Hq' + 2*Hkv' heads). The exchanges then send each rank
only `rank_heads(plan)`: the plan's slots without the dummies an uneven split can leave out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import comm

__all__ = ["HeadPlan", "RankHeads", "head_plan", "rank_heads", "sent_heads", "seq_to_heads", "heads_to_seq"]


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


@dataclass(frozen=True)
class RankHeads:
    """The heads one rank gets in pure Ulysses' fused exchange: original q heads (-1: a dummy, sent as zeros)
    and original kv heads (repeats: replicas); local q head j uses local kv head j // (len(q) // len(kv))."""

    q: tuple[int, ...]
    kv: tuple[int, ...]

    @property
    def width(self) -> int:
        return len(self.q) + 2 * len(self.kv)

    def chunk(self, c: int, chunks: int) -> RankHeads:
        """Chunk c of `chunks` near-equal parts of the kv heads and their q groups (may be empty)."""
        nk = len(self.kv)
        g = len(self.q) // nk if nk else 0
        a, b = c * nk // chunks, (c + 1) * nk // chunks
        return RankHeads(self.q[a * g : b * g], self.kv[a:b])


@lru_cache(maxsize=256)
def rank_heads(plan: HeadPlan) -> tuple[RankHeads, ...]:
    """Per rank, the plan's slots without what an uneven split can leave out (exact either way).

    A slot is one (possibly replicated) kv head and its `plan.group` q heads, real ones first. Slots of dummy
    kv groups (zeros, all their q heads dummies) and slots without a real q head are not sent at all; a rank
    whose remaining slots hold the same number c of real q heads each gets just those (GQA group c). Only
    where a rank's slots differ in that count do its dummy q heads stay (as zeros: a GQA group is uniform).
    Example: Hq=Hkv=6, P=4 plans 8 kv groups (2 dummy) and sends 2, 2, 2, 0 heads instead of 2 per rank."""
    p, g = plan.degree, plan.group
    kw = plan.expanded_kv_heads // p
    out = []
    for i in range(p):
        slots = [(plan.kv_src[j], plan.q_src[j * g : (j + 1) * g]) for j in range(i * kw, (i + 1) * kw)]
        slots = [(kv, qs) for kv, qs in slots if kv >= 0 and qs[0] >= 0]
        counts = {sum(h >= 0 for h in qs) for _, qs in slots}
        keep = counts.pop() if len(counts) == 1 else g
        out.append(RankHeads(tuple(h for _, qs in slots for h in qs[:keep]), tuple(kv for kv, _ in slots)))
    return tuple(out)


def sent_heads(plan: HeadPlan) -> tuple[int, int]:
    """(q heads, kv heads) Ulysses' exchange moves over all ranks: `rank_heads` (pure Ulysses and USP alike)."""
    ranks = rank_heads(plan)
    return sum(len(r.q) for r in ranks), sum(len(r.kv) for r in ranks)


def seq_to_heads(x: torch.Tensor, group, stats=None, device: torch.device | None = None) -> torch.Tensor:
    """[B, S/P, H, D] sequence shard -> [B, S, H/P, D] head shard (ranks' pieces in rank order)."""
    return comm.all_to_all(x, group, scatter_dim=2, gather_dim=1, stats=stats, channel="ulysses", device=device)


def heads_to_seq(x: torch.Tensor, group, stats=None, device: torch.device | None = None) -> torch.Tensor:
    """Inverse of seq_to_heads."""
    return comm.all_to_all(x, group, scatter_dim=1, gather_dim=2, stats=stats, channel="ulysses", device=device)
