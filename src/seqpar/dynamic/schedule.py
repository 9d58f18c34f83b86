"""One step's rows -> SP degrees, slots and micro-steps, balanced with the cost model (seqpar.dynamic.cost).

A row runs at the smallest degree d (of the ones given) whose tokens per rank are <= max_local_tokens (its padded
length / d, x its sequences: 2 for a DPO pair). A *slot* is one micro-batch on an aligned group of d ranks
(ranks [first, first + d), first a multiple of d): several short rows packed as documents of one row (SFT), or
batched and padded to the longest (DPO pairs, GRPO rows), up to max_local_tokens per rank. A *micro-step*
gives every rank at most one slot; ranks run their slots in micro-step order, so a group's members always meet
at the same slot (no deadlock whatever the costs).

Balance (list scheduling on predicted finish times): the rows that need d > 1 first (larger degrees first,
the most expensive first), each on the aligned block whose ranks are free soonest; then the d = 1 rows, most
expensive first, each where it finishes soonest: appended to a rank's open pack, to an open packed slot of
d > 1 that still has room (packing only), or as a new pack after a rank's last slot. Under FSDP2 (lockstep: a
micro-step lasts as long as its slowest slot) each placement minimises how much it lengthens the step instead.
A second plan lets a row of degree > 1 take a larger degree where its slot then ends sooner; the plan predicted
faster is used. A packed slot of a ring
degree orders its documents (longest first, last or in the middle) to give its ranks the most even attention
work: the cost is per document and per ring rank, not per token. Every rank computes the same plan from the
same rows: the arithmetic is deterministic, no communication is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import SeqParError
from .cost import RowCost

__all__ = ["Row", "Slot", "StepPlan", "Scheduler"]


@dataclass(frozen=True)
class Row:
    index: int  # the row's position among the step's rows
    length: int  # tokens of its (longest) sequence
    seqs: int = 1  # sequences it holds: 2 for a DPO pair (chosen, rejected)


@dataclass
class Slot:
    degree: int
    first: int  # first rank of its aligned group
    rows: list[Row]  # in the order the collator gets them (packed: document order)
    micro_step: int
    start: float = 0.0  # predicted start (s into the step)
    rank_s: list[float] = field(default_factory=list)  # predicted seconds on each of its ranks

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.degree)

    @property
    def seconds(self) -> float:
        return max(self.rank_s)


@dataclass
class StepPlan:
    """The step's slots by micro-step; predicted busy and finish times per rank."""

    world: int
    slots: list[Slot]
    micro_steps: int

    def of_rank(self, rank: int) -> list[Slot | None]:
        """This rank's slot in every micro-step (None: idle)."""
        out: list[Slot | None] = [None] * self.micro_steps
        for s in self.slots:
            if rank in s.ranks:
                out[s.micro_step] = s
        return out

    @property
    def degrees(self) -> dict[int, int]:
        """{degree: rows} of the step."""
        out: dict[int, int] = {}
        for s in self.slots:
            out[s.degree] = out.get(s.degree, 0) + len(s.rows)
        return dict(sorted(out.items()))

    def busy(self, idle_s: float = 0.0) -> list[float]:
        """Predicted seconds each rank spends in its slots, plus idle_s for each micro-step it has none (FSDP2:
        the dummy pass an idle rank runs to join the all-gathers)."""
        out = [0.0] * self.world
        for r in range(self.world):
            out[r] = idle_s * sum(s is None for s in self.of_rank(r))
        for s in self.slots:
            for i, r in enumerate(s.ranks):
                out[r] += s.rank_s[i]
        return out

    def finish(self) -> list[float]:
        """Predicted time each rank finishes its last slot (a group starts when its last member is free)."""
        done = [0.0] * self.world
        for s in sorted(self.slots, key=lambda s: s.micro_step):
            start = max(done[r] for r in s.ranks)
            for i, r in enumerate(s.ranks):
                done[r] = start + s.rank_s[i]
        return done

    def lockstep_s(self, idle_s: float = 0.0) -> float:
        """Predicted time when every micro-step waits for its slowest pass (FSDP2's per-layer all-gathers over
        the world): its slowest slot, or idle_s (an idle rank's dummy pass) where a rank has no slot."""
        worst = [0.0] * self.micro_steps
        held = [0] * self.micro_steps
        for s in self.slots:
            worst[s.micro_step] = max(worst[s.micro_step], s.seconds)
            held[s.micro_step] += s.degree
        return sum(max(w, idle_s if n < self.world else 0.0) for w, n in zip(worst, held))


class Scheduler:
    """Plans steps for one run: cost model, world size, max_local_tokens, the degrees allowed, packing."""

    def __init__(self, cost: RowCost, world: int, max_local_tokens: int, degrees: Sequence[int], packed: bool):
        self.cost, self.world, self.n, self.packed = cost, world, max_local_tokens, packed
        self.degrees = sorted(degrees)
        bad = [d for d in self.degrees if world % d]
        if bad:
            raise SeqParError(f"degrees {bad} do not divide the world size {world}")

    # ------------------------------------------------------------------ sizes
    def tokens(self, rows: Sequence[Row], d: int) -> int:
        """Tokens per rank of a slot holding `rows` at degree d."""
        if self.packed:
            return self.cost.local_tokens([[sum(r.length for r in rows)]], d)
        return sum(r.seqs for r in rows) * self.cost.full_length([[max(r.length for r in rows)]], d) // d

    def degree_of(self, row: Row) -> int:
        for d in self.degrees:
            if self.tokens([row], d) <= self.n:
                return d
        top = self.degrees[-1]
        raise SeqParError(f"a row of {row.length} tokens{' x 2 (a pair)' if row.seqs == 2 else ''} needs "
                          f"{self.tokens([row], top)} tokens per rank at the largest degree {top}, above "
                          f"max_local_tokens={self.n}: raise max_local_tokens or launch more ranks")

    def slot_rank_s(self, rows: Sequence[Row], d: int) -> tuple[list[Row], list[float]]:
        """(document order, predicted seconds per rank) of a slot."""
        if not self.packed:
            seqs = [[max(r.length for r in rows)]] * sum(r.seqs for r in rows)
            return list(rows), self.cost.rank_seconds(seqs, d, packed=False)
        best: tuple[list[Row], list[float]] | None = None
        for order in _orders(list(rows), self.cost.degree(d).ring > 1):
            s = self.cost.rank_seconds([[r.length for r in order]], d)
            if best is None or max(s) < max(best[1]) - 1e-15:
                best = (order, s)
        return best

    # ------------------------------------------------------------------ planning
    def plan(self, rows: Sequence[Row], lockstep: bool = False) -> StepPlan:
        """The step's slots. lockstep: every micro-step waits for its slowest slot (FSDP2's all-gathers over the
        world run per layer): minimise the sum of the micro-steps' longest slots; else each rank runs on as
        soon as its groups allow: minimise the last finish. Two plans are made, one with each row at the
        smallest degree that holds it, one where a row of degree > 1 may take a larger degree when that ends its
        slot sooner (a long row on few ranks would hold up the others); the one predicted faster is kept."""
        plans = [self._plan(rows, lockstep, raise_degrees=r) for r in (False, True)]
        return min(plans, key=lambda p: self.step_s(p, lockstep))

    @property
    def idle_s(self) -> float:
        """Predicted seconds of an idle rank's dummy pass under FSDP2 (train/loop/dynamic.dummy_batch: one row of
        2 tokens at degree 1; its host work and weight all-gathers are most of it)."""
        return self.cost.rank_seconds([[2]], 1)[0]

    def step_s(self, plan: StepPlan, lockstep: bool) -> float:
        """The plan's predicted time: lockstep (FSDP2), the micro-steps' slowest passes, idle ranks' dummy passes
        included; else the last rank's finish."""
        return plan.lockstep_s(self.idle_s) if lockstep else max(plan.finish(), default=0.0)

    def _plan(self, rows: Sequence[Row], lockstep: bool, raise_degrees: bool) -> StepPlan:
        need = [(self.degree_of(r), r) for r in rows]
        small = [r for d, r in need if d == 1]
        big = [(d, r) for d, r in need if d > 1]
        alone = {(r.index, e): self.slot_rank_s([r], e)[1] for d, r in big
                 for e in self.degrees if e == d or (raise_degrees and e > d)}
        big.sort(key=lambda x: (-x[0], -max(alone[(x[1].index, x[0])]), x[1].index))
        st = _State(self.world)
        for _, r in big:
            options = [(*self._place_big(st, e, lockstep, max(alone[(r.index, e)])), e)
                       for e in self.degrees if (r.index, e) in alone]
            _, k, first, e = min(options)
            st.add((k, first), [r], alone[(r.index, e)])
        cost1 = {r.index: self.slot_rank_s([r], 1)[1][0] for r in small}
        for r in sorted(small, key=lambda r: (-cost1[r.index], r.index)):
            self._place_small(st, r, cost1[r.index], lockstep)
        return StepPlan(self.world, st.slots, st.micro_steps)

    def _place_big(self, st: _State, d: int, lockstep: bool, cost: float) -> tuple[float, int, int]:
        """(score, micro-step, first rank) of a new slot of degree d: its predicted finish, or (lockstep) how much
        it lengthens the step."""
        blocks = range(0, self.world, d)
        if not lockstep:
            first = min(blocks, key=lambda b: (max(st.done[b:b + d]), b))
            return max(st.done[first:first + d]) + cost, st.next_step(range(first, first + d)), first
        options = [(max(0.0, cost - st.worst(k)), k, b) for k in range(st.micro_steps) for b in blocks
                   if st.free(k, range(b, b + d))]
        options.append((cost, st.micro_steps, 0))
        return min(options)

    def _place_small(self, st: _State, row: Row, alone_s: float, lockstep: bool) -> None:
        """The cheapest place for a d = 1 row (see the module docstring); ties: the fuller slot first."""
        best = None  # (score, new slot?, tie, where, order, rank_s)
        for s in st.growable(lockstep):
            if (s.degree > 1 and not self.packed) or self.tokens(s.rows + [row], s.degree) > self.n:
                continue
            order, rank_s = self.slot_rank_s(s.rows + [row], s.degree)
            score = max(0.0, max(rank_s) - st.worst(s.micro_step, s)) if lockstep else s.start + max(rank_s)
            cand = (score, 0, (s.micro_step, s.first), s, order, rank_s)
            best = cand if best is None or cand[:3] < best[:3] else best
        for r in range(self.world):
            if lockstep:
                ks = [k for k in range(st.micro_steps) if st.free(k, range(r, r + 1))] + [st.micro_steps]
                k = min(ks, key=lambda k: (max(0.0, alone_s - st.worst(k)), k))
                score = max(0.0, alone_s - st.worst(k))
            else:
                k, score = st.next_step(range(r, r + 1)), st.done[r] + alone_s
            cand = (score, 1, (k, r), (k, r), [row], [alone_s])
            best = cand if best is None or cand[:3] < best[:3] else best
        _, new, _, where, order, rank_s = best
        if new:
            st.add(where, order, rank_s)
        else:
            st.grow(where, order, rank_s)


class _State:
    """The slots placed so far, by micro-step and rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[Slot] = []
        self.cell: dict[tuple[int, int], Slot] = {}  # (micro-step, rank) -> its slot
        self.done = [0.0] * world  # predicted finish of each rank's last slot (micro-step order)
        self.last: list[Slot | None] = [None] * world
        self._worst: list[float] = []  # the longest slot of each micro-step

    @property
    def micro_steps(self) -> int:
        return 1 + max((s.micro_step for s in self.slots), default=-1)

    def free(self, k: int, ranks: range) -> bool:
        return all((k, r) not in self.cell for r in ranks)

    def worst(self, k: int, but: Slot | None = None) -> float:
        """The longest slot of micro-step k (other than `but`)."""
        if but is None:
            return self._worst[k] if k < len(self._worst) else 0.0
        return max((s.seconds for s in self.slots if s.micro_step == k and s is not but), default=0.0)

    def next_step(self, ranks: range) -> int:
        """The micro-step after the last one any of these ranks has a slot in."""
        return 1 + max((self.last[r].micro_step for r in ranks if self.last[r] is not None), default=-1)

    def growable(self, lockstep: bool) -> list[Slot]:
        """Slots a row may join: any (lockstep), else the last slot of each of its ranks (a rank's earlier slots
        are followed by others whose predicted start would move)."""
        if lockstep:
            return list(self.slots)
        return [s for s in self.slots if all(self.last[r] is s for r in s.ranks)]

    def add(self, where: tuple[int, int], rows: list[Row], rank_s: list[float]) -> None:
        k, first = where
        slot = Slot(len(rank_s), first, rows, k, rank_s=rank_s)
        self.slots.append(slot)
        for r in slot.ranks:
            self.cell[(k, r)] = slot
        self._retime()

    def grow(self, slot: Slot, rows: list[Row], rank_s: list[float]) -> None:
        slot.rows, slot.rank_s = rows, rank_s
        self._retime()

    def _retime(self) -> None:
        """Each rank's chain in micro-step order: a slot starts when its last member is free."""
        self.done = [0.0] * self.world
        self.last = [None] * self.world
        self._worst = [0.0] * self.micro_steps
        for s in sorted(self.slots, key=lambda s: s.micro_step):
            self._worst[s.micro_step] = max(self._worst[s.micro_step], s.seconds)
            s.start = max(self.done[r] for r in s.ranks)
            for i, r in enumerate(s.ranks):
                self.done[r] = s.start + s.rank_s[i]
                self.last[r] = s


def _orders(rows: list[Row], ring: bool) -> list[list[Row]]:
    """Document orders worth costing for a packed slot: as given (no ring: the order changes nothing), else
    longest first, longest last, and the longest in the middle of the shorter ones."""
    if not ring or len(rows) < 2:
        return [rows]
    desc = sorted(rows, key=lambda r: (-r.length, r.index))
    rest = desc[1:]
    half = len(rest) // 2
    return [desc, desc[::-1], rest[:half][::-1] + [desc[0]] + rest[half:]]
