"""`seqpar plan --lengths`: a dataset's length mix -> predicted tokens/s of a fixed SP layout and of length-aware SP
(`size: dynamic`), with one cost model of a micro-batch (planner.dynamic.row_cost: this planner's time model) and
the scheduler `seqpar train` runs (seqpar.dynamic.schedule).

Lengths: a histogram "share:lo-hi,share:len,..." (each bucket's rows spread log-uniformly over [lo, hi]) or a file
(a JSON list of lengths; JSONL rows with "input_ids" or "length"; or one length per line). The sample is shuffled
with a fixed seed and cut into steps of `rows_per_step` rows (the fixed run's global batch).

Per step, the fixed layout (ulysses x ring x dp) runs each row as one micro-batch of its dp group (`packed`: SFT
rows greedily packed into rows of the longest length, as dataset.packing does); under FSDP2 the groups move in
lockstep (per-layer all-gathers over the world), else each group's rows add up. Length-aware SP runs the plan of
the same rows. Both add their per-step constants (optimizer, gradient sums).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from ..dynamic.schedule import Row, Scheduler
from ..errors import SeqParError
from ..layout import round_up_length
from .dynamic import degree_needed, max_local_tokens, row_cost, world_degrees
from .gpus import Cluster
from .memory import Features, Layout, Workload
from .model import ModelFacts
from .search import Request, feature_sets, plan

__all__ = ["parse_lengths", "MixResult", "predict_mix", "plan_mix", "candidate_ns"]


def _histogram(spec: str, rows: int) -> list[int]:
    out: list[int] = []
    buckets = []
    for part in spec.split(","):
        try:
            share, span = part.split(":")
            lo, _, hi = span.partition("-")
            buckets.append((float(share), int(lo), int(hi or lo)))
        except ValueError:
            raise SeqParError(f"--lengths bucket {part!r}: write share:lo-hi or share:length, e.g. "
                              "0.9:512-4096,0.09:4096-32768,0.01:131072") from None
    total = sum(s for s, _, _ in buckets)
    if total <= 0 or any(s < 0 or lo < 1 or hi < lo for s, lo, hi in buckets):
        raise SeqParError(f"--lengths {spec!r}: shares must be >= 0 (not all 0), lengths 1 <= lo <= hi")
    for share, lo, hi in buckets:
        k = round(share / total * rows)
        for i in range(k):  # quantiles of a log-uniform spread
            out.append(int(round(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * (i + 0.5) / k))))
    return out


def _from_file(path: Path) -> list[int]:
    text = path.read_text()
    try:
        data = json.loads(text)
        if isinstance(data, list):
            return [int(x) for x in data]
    except ValueError:
        pass
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line[0] == "{":
            row = json.loads(line)
            out.append(int(row["length"]) if "length" in row else len(row["input_ids"]))
        else:
            out.append(int(line))
    return out


def parse_lengths(spec: str, rows: int = 4096, seed: int = 0) -> list[int]:
    """The row lengths of a histogram spec (`rows` of them) or a file, shuffled with `seed`."""
    path = Path(spec)
    try:
        lengths = _from_file(path) if path.is_file() else _histogram(spec, rows)
    except (KeyError, TypeError, ValueError) as e:
        raise SeqParError(f"--lengths {spec}: cannot read lengths ({type(e).__name__}: {e}): give a histogram "
                          "share:lo-hi,... or a JSON list / JSONL (input_ids or length) / one length per line") \
            from None
    if not lengths or min(lengths) < 1:
        raise SeqParError(f"--lengths {spec}: no rows, or a length below 1")
    random.Random(seed).shuffle(lengths)
    return lengths


@dataclass
class MixResult:
    fixed: Layout
    fixed_s: float  # seconds over every step
    fixed_packed_s: float | None  # SFT: rows packed to the longest length
    dynamic_s: float
    tokens: int
    degrees: dict[int, int]  # rows per degree under length-aware SP
    max_local_tokens: int
    steps: int

    def as_json(self) -> dict:
        tps = {k: self.tokens / v for k, v in (("fixed", self.fixed_s), ("fixed_packed", self.fixed_packed_s),
                                              ("dynamic", self.dynamic_s)) if v}
        return {"fixed_layout": {"ulysses": self.fixed.ulysses, "ring": self.fixed.ring, "dp": self.fixed.dp},
                "tokens_per_s": tps, "speedup_vs_fixed": tps["dynamic"] / tps["fixed"],
                "speedup_vs_fixed_packed": (tps["dynamic"] / tps["fixed_packed"]) if "fixed_packed" in tps else None,
                "sp_degrees": {str(k): v for k, v in self.degrees.items()}, "max_local_tokens": self.max_local_tokens,
                "steps": self.steps, "tokens": self.tokens}


def _fixed_step(costs: list[list[float]], lockstep: bool) -> float:
    """One step of a fixed layout: costs[g] = its dp group's micro-batches in order."""
    if lockstep:
        k = max(len(c) for c in costs)
        return sum(max(c[i] if i < len(c) else 0.0 for c in costs) for i in range(k))
    return max(sum(c) for c in costs)


def _packs(lengths: list[int], cap: int) -> list[list[int]]:
    """Greedy, order-preserving packing into rows of at most `cap` tokens (train.dataset.tokenize.pack_rows)."""
    out: list[list[int]] = []
    for n in lengths:
        if out and sum(out[-1]) + n <= cap:
            out[-1].append(n)
        else:
            out.append([n])
    return out


def predict_mix(m: ModelFacts, cl: Cluster, wl: Workload, feats: Features, lengths: list[int], fixed: Layout,
                degrees: dict[int, tuple[int, int]], n: int, rows_per_step: int) -> MixResult:
    """Fixed `fixed` vs length-aware SP at max_local_tokens `n` over `lengths`, steps of rows_per_step rows."""
    seqs = 2 if wl.stage == "dpo" else 1
    top = degree_needed(max(lengths), seqs, degrees, n)
    dyn_degrees = {d: v for d, v in degrees.items() if d <= top}
    world = fixed.world
    rc_dyn = row_cost(m, wl, feats, cl, dyn_degrees, world)
    rc_fix = row_cost(m, wl, feats, cl, {fixed.sp: (fixed.ulysses, fixed.ring)}, world, step_layout=fixed)
    sched = Scheduler(rc_dyn, world, n, sorted(dyn_degrees), packed=wl.stage == "sft")
    lock = feats.fsdp
    steps = [lengths[i:i + rows_per_step] for i in range(0, len(lengths) - rows_per_step + 1, rows_per_step)]
    if not steps:
        raise SeqParError(f"{len(lengths)} rows do not make one step of {rows_per_step}: lower --rows-per-step")
    fixed_s = packed_s = dyn_s = 0.0
    used: dict[int, int] = {}
    cap = max(lengths)
    for rows in steps:
        one = [[rc_fix.seconds([[n_]] * seqs, fixed.sp, packed=False) for n_ in rows[g::fixed.dp]]
               for g in range(fixed.dp)]
        fixed_s += _fixed_step(one, lock) + rc_fix.step_s
        if seqs == 1:
            packs = [[rc_fix.seconds([p], fixed.sp) for p in _packs(rows[g::fixed.dp], cap)] for g in range(fixed.dp)]
            packed_s += _fixed_step(packs, lock) + rc_fix.step_s
        plan = sched.plan([Row(i, x, seqs) for i, x in enumerate(rows)], lockstep=lock)
        dyn_s += sched.step_s(plan, lock) + rc_dyn.step_s
        for d, k in plan.degrees.items():
            used[d] = used.get(d, 0) + k
    tokens = sum(seqs * x for rows in steps for x in rows)
    return MixResult(fixed, fixed_s, packed_s if seqs == 1 else None, dyn_s, tokens, dict(sorted(used.items())), n,
                     len(steps))


def candidate_ns(need: int, top: int, multiple: int = 64) -> list[int]:
    """max_local_tokens worth predicting: what the longest row needs at the largest degree, the memory bound, and
    the powers of two between (rounded to `multiple`)."""
    lo = -(-need // multiple) * multiple
    out = {lo, top}
    k = 1
    while k < top:
        if k > lo:
            out.add(k)
        k *= 2
    return sorted(n for n in out if lo <= n <= top)


def plan_mix(m: ModelFacts, cl: Cluster, req: Request, lengths: list[int], n: int | None = None,
             rows_per_step: int = 64) -> dict:
    """The fixed layout `seqpar plan` recommends for the longest row, against length-aware SP with each feature set
    the request allows and each max_local_tokens worth trying (or `n`) that the memory model fits at every degree:
    the best of those, and the memory bound of its features. SeqParError when nothing fits."""
    wl = replace(req.workload, seq_len=max(lengths))
    cands, rec = plan(m, cl, replace(req, workload=wl))
    if rec is None:
        raise SeqParError(f"no fixed layout fits a row of {max(lengths)} tokens on {cl.gpus} x {cl.name}: add GPUs "
                          "or memory features (see `seqpar plan --seq-len`)")
    fixed = cands[rec]
    world, seqs = cl.gpus, 2 if wl.stage == "dpo" else 1
    degrees = world_degrees(m, world, node_size=cl.gpus_per_node)
    best, tried = None, []
    for f in feature_sets(req):
        bound = max_local_tokens(m, wl, f, cl, degrees, world)
        need = seqs * max_local_need(max(lengths), degrees)
        ns = [n] if n is not None else candidate_ns(need, bound)
        for k in ns:
            if k < need or k > bound:
                continue
            res = predict_mix(m, cl, wl, f, lengths, fixed.layout, degrees, k, rows_per_step)
            tried.append((k, f))
            if best is None or res.dynamic_s < best[0].dynamic_s:
                best = (res, f, bound)
    if best is None:
        raise SeqParError(f"no max_local_tokens{'' if n is None else f' = {n}'} fits both the longest row "
                          f"({max(lengths)} tokens) at the largest degree and the memory at every degree: raise "
                          "--max-local-tokens, allow more memory features, or add GPUs")
    res, f, bound = best
    return {**res.as_json(), "fixed_features": fixed.features.as_dict(), "dynamic_features": f.as_dict(),
            "memory_max_local_tokens": bound, "tried": len(tried), "rows_per_step": rows_per_step,
            "longest": max(lengths), "rows": len(lengths)}


def max_local_need(length: int, degrees: dict[int, tuple[int, int]], layout: str = "zigzag") -> int:
    """Tokens per rank a row of `length` tokens needs at the largest degree (one sequence)."""
    top = max(degrees)
    u, r = degrees[top]
    return round_up_length(length, r, u, layout) // top
