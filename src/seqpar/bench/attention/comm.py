"""Part 1 of the attention benchmark: communication bytes per rank for one attention call, forward and backward,
for Ulysses / ring (zigzag) / USP on 4 gloo ranks, counted in seqpar's collective wrappers (mesh.stats) and, as
a cross-check, at torch.distributed's entry points; next to the byte formulas of seqpar.attention.costs with
the original head counts and with the heads seqpar's Ulysses head plan moves. DeepSpeed's Ulysses on the same
shards, when installed. The rank code, the assembly of the JSON rows and their markdown table live here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...attention.costs import usp_theory
from .inputs import FWD_BWD, qkv, ratio

__all__ = ["comm_cases", "theory_for", "measure_comm", "measure_deepspeed", "ds_runs_safely", "run_deepspeed_alone",
           "assemble_comm", "comm_section", "case_label", "comm_lines"]


def comm_cases(quick: bool) -> list[dict[str, Any]]:
    """(mode, ulysses, ring, hq, hkv, dtype) grid measured on 4 ranks."""
    heads = [(8, 8), (8, 2), (14, 2), (6, 6)]
    cases = []
    for hq, hkv in heads:
        cases.append({"mode": "ulysses", "ulysses_degree": 4, "ring_degree": 1, "num_heads": hq, "num_kv_heads": hkv})
    for hq, hkv in heads[:3]:
        cases.append({"mode": "ring", "ulysses_degree": 1, "ring_degree": 4, "num_heads": hq, "num_kv_heads": hkv})
    for hq, hkv in heads + [(9, 3)]:  # 9q/3kv at ulysses 2: the plan pads to 12/4, the exchange sends 9/3
        cases.append({"mode": "usp", "ulysses_degree": 2, "ring_degree": 2, "num_heads": hq, "num_kv_heads": hkv})
    for c in cases:
        c["dtype"] = "float32"
    # bf16 inputs: K/V travel in bf16, but the ring's dK/dV travel in the fp32 accumulation dtype.
    cases.append(
        {"mode": "ring", "ulysses_degree": 1, "ring_degree": 4, "num_heads": 8, "num_kv_heads": 2, "dtype": "bfloat16"}
    )
    return cases


def theory_for(case: dict[str, Any], seq: int, d: int, hq: int, hkv: int) -> dict[str, int]:
    elt = torch.empty(0, dtype=getattr(torch, case["dtype"])).element_size()
    return usp_theory(seq, 1, hq, hkv, d, case["ulysses_degree"], case["ring_degree"], elt)


@contextlib.contextmanager
def _count_torch_collectives(sent: list[int]) -> Iterator[None]:
    """Independent check of seqpar's own accounting: count, at the torch.distributed entry points
    seqpar.comm uses (all_to_all_single, batch_isend_irecv), the bytes this rank sends to others."""
    a2a, batch = dist.all_to_all_single, dist.batch_isend_irecv

    def counting_a2a(output, input, *args, **kwargs):
        group = kwargs.get("group")
        p, me = dist.get_world_size(group), dist.get_rank(group)
        splits = args[1] if len(args) > 1 else kwargs.get("input_split_sizes")
        # everything but this rank's own chunk leaves the rank (equal chunks unless split sizes are given)
        own = splits[me] if splits else input.numel() // p
        sent.append((input.numel() - own) * input.element_size())
        return a2a(output, input, *args, **kwargs)

    def counting_batch(ops):
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = counting_a2a, counting_batch
    try:
        yield
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = a2a, batch


def measure_comm(case: dict[str, Any], seq: int, d: int, meshes: dict) -> dict[str, Any]:
    import seqpar

    from ...attention.ulysses import head_plan, sent_heads

    u, r = case["ulysses_degree"], case["ring_degree"]
    mesh = meshes[(u, r)]
    dtype = getattr(torch, case["dtype"])
    full = qkv(seq, case["num_heads"], case["num_kv_heads"], d, dtype)
    q, k, v = (seqpar.shard(t, mesh) for t in full)
    for t in (q, k, v):
        t.requires_grad_(True)
    # Independent float64 reference on the full sequence: the measured call must also be right.
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in full), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    dist.barrier()
    seen: list[int] = []
    with _count_torch_collectives(seen):
        mesh.stats.reset()
        out = seqpar.attention(q, k, v, mesh, causal=True)
        fwd = dict(mesh.stats.bytes)
        fwd_calls = dict(mesh.stats.calls)
        torch_fwd = sum(seen)
        seen.clear()
        mesh.stats.reset()
        out.backward(torch.ones_like(out))
        bwd = dict(mesh.stats.bytes)
        bwd_calls = dict(mesh.stats.calls)
        torch_bwd = sum(seen)
        mesh.stats.reset()
    plan = head_plan(case["num_heads"], case["num_kv_heads"], u)
    err = (out.detach().double() - seqpar.shard(ref, mesh)).abs().max().item()
    return {
        "bytes": {**fwd, **bwd},
        "max_abs_err_vs_fp64_reference": err,
        "torch_distributed_bytes": {"fwd": torch_fwd, "bwd": torch_bwd},
        "calls": {**fwd_calls, **bwd_calls},
        "fwd_channels": sorted(fwd),
        "bwd_channels": sorted(bwd),
        "plan": {
            "padded_heads": plan.padded_heads,
            "expanded_kv_heads": plan.expanded_kv_heads,
            "kv_replicas": plan.rep,
            "dummy_q_heads": plan.dummy_heads,
            "sent_heads": list(sent_heads(plan)),
        },
    }


def measure_deepspeed(case: dict[str, Any], seq: int, d: int, mesh, raise_errors: bool = False) -> dict[str, Any]:
    """DeepSpeed Ulysses on the same shards as seqpar: bytes per pass, and max |difference| to seqpar."""
    import seqpar

    from ..peers import DeepSpeedUlysses, count_deepspeed_bytes

    hq, hkv = case["num_heads"], case["num_kv_heads"]
    full = qkv(seq, hq, hkv, d, getattr(torch, case["dtype"]))
    shards = [seqpar.shard(t, mesh) for t in full]
    grads = {}
    outs = {}
    sent: list[int] = []
    for name in ("seqpar", "deepspeed"):
        q, k, v = (t.detach().requires_grad_(True) for t in shards)
        if name == "seqpar":
            out = seqpar.attention(q, k, v, mesh, causal=True)
            out.backward(torch.ones_like(out))
        else:
            try:
                with count_deepspeed_bytes(sent):
                    out = DeepSpeedUlysses(mesh.ulysses_group, hkv)(q, k, v)
                    fwd = sum(sent)
                    sent.clear()
                    out.backward(torch.ones_like(out))
                    bwd = sum(sent)
            except Exception as e:  # the peer refuses this head configuration: record why
                if raise_errors:
                    raise
                return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
        outs[name] = out.detach()
        grads[name] = [t.grad for t in (q, k, v)]
    diff = max(
        (outs["seqpar"] - outs["deepspeed"]).abs().max().item(),
        *((a - b).abs().max().item() for a, b in zip(grads["seqpar"], grads["deepspeed"])),
    )
    return {"measured_bytes": {"fwd": fwd, "bwd": bwd}, "max_abs_diff_vs_seqpar_out_and_grads": diff}


def rank_deepspeed_alone(case: dict[str, Any], seq: int, d: int) -> dict[str, Any]:
    """A configuration that may hang DeepSpeed's collectives gets its own world (and a timeout)."""
    import seqpar

    from ..peers import setup_deepspeed

    setup_deepspeed()
    mesh = seqpar.init_mesh(dist.get_world_size(), ulysses_degree=case["ulysses_degree"], ring_degree=1)
    return measure_deepspeed(case, seq, d, mesh, raise_errors=True)


def ds_runs_safely(case: dict[str, Any]) -> bool:
    """False where DeepSpeed takes its uneven-heads path (Hkv >= P, P does not divide Hkv): that path can
    fail on some ranks only and leave the others blocked, so it runs in a world of its own."""
    p, hkv = case["ulysses_degree"], case["num_kv_heads"]
    return hkv % p == 0 or hkv < p


def _deepspeed_row(i: int, case: dict[str, Any], per_rank: list, alone: dict, seq: int, d: int) -> Any:
    if i in alone:
        return alone[i]
    ds = [pr["deepspeed"].get(i) for pr in per_rank]
    if ds[0] is None:
        return None
    row = dict(ds[0])
    if "measured_bytes" in row:
        row["same_on_all_ranks"] = all(x["measured_bytes"] == row["measured_bytes"] for x in ds)
        row["max_abs_diff_vs_seqpar_out_and_grads"] = max(x["max_abs_diff_vs_seqpar_out_and_grads"] for x in ds)
        th = theory_for(case, seq, d, case["num_heads"], case["num_kv_heads"])["ulysses_fwd"]
        row["ratio_vs_original_heads"] = {p: ratio(row["measured_bytes"][p], th) for p in FWD_BWD}
    return row


def run_deepspeed_alone(cases, seq: int, d: int, timeout: float) -> dict[int, Any]:
    from seqpar.spawn import DistributedFailure, run_distributed

    out = {}
    for i, c in enumerate(cases):
        if c["mode"] != "ulysses" or ds_runs_safely(c):
            continue
        try:
            out[i] = run_distributed(rank_deepspeed_alone, 4, c, seq, d, timeout=min(timeout, 90.0))[0]
        except DistributedFailure as e:
            msg = [ln.strip() for ln in str(e).splitlines() if "Error" in ln or "timed out" in ln]
            out[i] = {"error": (msg[-1] if msg else str(e).splitlines()[0])[:400]}
    return out


def assemble_comm(cases, per_rank, seq, d, alone=None) -> list[dict[str, Any]]:
    from ...attention.ulysses import head_plan, sent_heads

    rows = []
    for i, case in enumerate(cases):
        ranks = [pr["comm"][i] for pr in per_rank]
        # uneven head sets (pure Ulysses without dummies) send different bytes per rank: the mean over ranks
        # is what the symmetric formula with the heads really sent gives
        channels_all = {c for rk in ranks for c in rk["bytes"]}
        measured = {c: sum(rk["bytes"].get(c, 0) for rk in ranks) / len(ranks) for c in channels_all}
        measured = {c: int(b) if float(b).is_integer() else b for c, b in measured.items()}
        plan = head_plan(case["num_heads"], case["num_kv_heads"], case["ulysses_degree"])
        th_plan = theory_for(case, seq, d, *sent_heads(plan))
        th_orig = theory_for(case, seq, d, case["num_heads"], case["num_kv_heads"])
        channels = ("ulysses_fwd", "ulysses_bwd", "ring_fwd", "ring_bwd")
        m = {c: measured.get(c, 0) for c in channels}
        totals = {
            "measured": {p: m[f"ulysses_{p}"] + m[f"ring_{p}"] for p in FWD_BWD},
            "theory_plan_heads": {p: th_plan[f"ulysses_{p}"] + th_plan[f"ring_{p}"] for p in FWD_BWD},
            "theory_original_heads": {p: th_orig[f"ulysses_{p}"] + th_orig[f"ring_{p}"] for p in FWD_BWD},
        }
        rows.append(
            {
                **case,
                "seq_len": seq,
                "head_dim": d,
                "batch": 1,
                "world_size": len(per_rank),
                "plan": ranks[0]["plan"],
                "measured_bytes": m,
                "other_channels": {c: b for c, b in measured.items() if c not in channels},
                "calls": ranks[0]["calls"],
                # pure Ulysses with uneven head sets: ranks send different bytes (the mean is compared above)
                "same_on_all_ranks": all(r["bytes"] == ranks[0]["bytes"] for r in ranks),
                "measured_per_rank": [{p: sum(b for c, b in r["bytes"].items() if c.endswith(p)) for p in FWD_BWD}
                                      for r in ranks],
                # Bytes seen at torch.distributed's entry points, for a check of the wrappers' own count.
                "torch_distributed_bytes_per_rank": [r["torch_distributed_bytes"] for r in ranks],
                "max_abs_err_vs_fp64_reference": max(r["max_abs_err_vs_fp64_reference"] for r in ranks),
                "theory_plan_heads": {c: th_plan[c] for c in channels},
                "theory_original_heads": {c: th_orig[c] for c in channels},
                "ring_bwd_lower_bound_plan_heads": th_plan["ring_bwd_min"],
                "totals": totals,
                "ratio_vs_plan_heads": {
                    p: ratio(totals["measured"][p], totals["theory_plan_heads"][p]) for p in FWD_BWD
                },
                "ratio_vs_original_heads": {
                    p: ratio(totals["measured"][p], totals["theory_original_heads"][p]) for p in FWD_BWD
                },
                "deepspeed": _deepspeed_row(i, case, per_rank, alone or {}, seq, d),
            }
        )
    return rows


def comm_section(cases: list[dict[str, Any]], per_rank: list, seq: int, d: int, alone: dict | None) -> dict[str, Any]:
    """The JSON document's "comm_bytes" part."""
    return {
        "description": (
            "bytes sent per rank for one attention call, counted in seqpar's collective wrappers "
            "(mesh.stats), vs seqpar.attention.costs with original and with head-plan head counts"
        ),
        "world_size": 4,
        "cases": assemble_comm(cases, per_rank, seq, d, alone),
    }


def case_label(c: dict[str, Any]) -> str:
    dt = "" if c["dtype"] == "float32" else f" {c['dtype']}"
    return f"{c['mode']} u{c['ulysses_degree']}r{c['ring_degree']} {c['num_heads']}q/{c['num_kv_heads']}kv{dt}"


def comm_lines(section: dict[str, Any], deepspeed_version: str | None) -> list[str]:
    """Markdown table of the "comm_bytes" part (and DeepSpeed's bytes on the same shards, when measured)."""
    out = ["### Communication bytes per rank, one attention call (4 ranks)", ""]
    cases = section["cases"]
    c0 = cases[0]
    out.append(
        f"S={c0['seq_len']}, B=1, D={c0['head_dim']}; bytes per rank; ratio = measured / theory "
        "(the byte formulas of seqpar.attention.costs with the original heads / with the heads the Ulysses plan "
        "moves); strict bound = "
        "the plan's heads with dK/dV reduced in R-1 ring hops (a reduce-scatter)."
    )
    out.append("")
    out.append(
        "| case | heads moved (q/kv) | fwd measured | fwd theory (orig heads) | fwd ratio orig / plan "
        "| bwd measured | bwd theory (orig heads) | bwd ratio orig / plan | bwd / strict bound | max err vs fp64 |"
    )
    out.append("|---|---|---:|---:|---|---:|---:|---|---:|---:|")
    for c in cases:
        t, ro, rp = c["totals"], c["ratio_vs_original_heads"], c["ratio_vs_plan_heads"]
        heads = "/".join(map(str, c["plan"]["sent_heads"])) if c["ulysses_degree"] > 1 else "-"
        # Strict bound: dK/dV reduced in R-1 hops (the plan's heads); seqpar's ring is at it.
        bound = c["theory_plan_heads"]["ulysses_bwd"] + c["ring_bwd_lower_bound_plan_heads"]
        out.append(
            f"| {case_label(c)} | {heads} | {t['measured']['fwd']:,} | {t['theory_original_heads']['fwd']:,} "
            f"| {ro['fwd']:.3f} / {rp['fwd']:.3f} | {t['measured']['bwd']:,} | "
            f"{t['theory_original_heads']['bwd']:,} | {ro['bwd']:.3f} / {rp['bwd']:.3f} | "
            f"{t['measured']['bwd'] / bound:.3f} | {c['max_abs_err_vs_fp64_reference']:.1e} |"
        )
    ds = [c for c in cases if c.get("deepspeed")]
    if ds:
        out += ["", f"DeepSpeed {deepspeed_version} `DistributedAttention` (Ulysses) on the same shards:", ""]
        out.append("| case | fwd bytes | bwd bytes | ratio vs orig-heads theory | max abs diff vs seqpar |")
        out.append("|---|---:|---:|---:|---:|")
        for c in ds:
            d = c["deepspeed"]
            if "error" in d:
                out.append(f"| {case_label(c)} | - | - | fails: `{d['error']}` | - |")
            else:
                mb = d["measured_bytes"]
                out.append(
                    f"| {case_label(c)} | {mb['fwd']:,} | {mb['bwd']:,} | {d['ratio_vs_original_heads']['fwd']:.3f} "
                    f"| {d['max_abs_diff_vs_seqpar_out_and_grads']:.1e} |"
                )
    return out
