"""Length-aware SP under FSDP2 (lockstep): an idle rank runs a dummy pass each micro-step it has no slot, and the
scheduler costs it (Scheduler.idle_s): in the plan's predicted step time (a micro-step with an idle rank lasts at
least that pass), in each rank's predicted busy time, and in the plan it chooses. Pure Python: no processes."""

from __future__ import annotations

from seqpar.dynamic.cost import DegreeCost, Machine, RowCost
from seqpar.dynamic.schedule import Row, Scheduler, Slot, StepPlan


def _scheduler(host_s: float) -> Scheduler:
    per = tuple((d, DegreeCost(d, 1, 1e-4, (), host_s, 0.0)) for d in (1, 2))
    cost = RowCost(per, 4, 2, 8, 2, 4.5, 1e9, "zigzag", Machine(overlap=False))
    return Scheduler(cost, 2, 64, [1, 2], packed=True)


def test_idle_passes_count_in_a_lockstep_step_only_where_a_rank_is_idle():
    one = StepPlan(2, [Slot(1, 0, [Row(0, 8)], 0, rank_s=[0.1])], 1)  # rank 1 idle
    both = StepPlan(2, [Slot(1, 0, [Row(0, 8)], 0, rank_s=[0.1]), Slot(1, 1, [Row(1, 8)], 0, rank_s=[0.1])], 1)
    assert one.lockstep_s(0.5) == 0.5 and both.lockstep_s(0.5) == 0.1
    assert one.busy(0.5) == [0.1, 0.5] and one.busy() == [0.1, 0.0]


def test_the_scheduler_costs_the_dummy_pass():
    sched = _scheduler(host_s=0.2)
    assert 0.2 <= sched.idle_s < 0.21  # the pass's host work: its 2 tokens cost little
    plan = sched.plan([Row(0, 60), Row(1, 100)], lockstep=True)  # 100 tokens need both ranks, 60 one
    idle = [r for k in range(plan.micro_steps) for r in range(2) if plan.of_rank(r)[k] is None]
    assert len(idle) == 1
    assert sched.step_s(plan, True) == plan.lockstep_s(sched.idle_s)
    assert abs(sum(plan.busy(sched.idle_s)) - sum(plan.busy()) - len(idle) * sched.idle_s) < 1e-12
