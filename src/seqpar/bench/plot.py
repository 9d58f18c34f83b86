"""Render the attention benchmark JSON: a 3-panel PNG and markdown tables (used for docs/benchmarks.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["plot_attention", "plot_step", "summary_lines"]


def _case_label(c: dict[str, Any]) -> str:
    dt = "" if c["dtype"] == "float32" else f" {c['dtype']}"
    return f"{c['mode']} u{c['ulysses_degree']}r{c['ring_degree']} {c['num_heads']}q/{c['num_kv_heads']}kv{dt}"


def summary_lines(res: dict[str, Any]) -> list[str]:
    """Markdown tables of the three parts."""
    out = ["### Communication bytes per rank, one attention call (4 ranks)", ""]
    cases = res["comm_bytes"]["cases"]
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
            f"| {_case_label(c)} | {heads} | {t['measured']['fwd']:,} | {t['theory_original_heads']['fwd']:,} "
            f"| {ro['fwd']:.3f} / {rp['fwd']:.3f} | {t['measured']['bwd']:,} | "
            f"{t['theory_original_heads']['bwd']:,} | {ro['bwd']:.3f} / {rp['bwd']:.3f} | "
            f"{t['measured']['bwd'] / bound:.3f} | {c['max_abs_err_vs_fp64_reference']:.1e} |"
        )
    ds = [c for c in cases if c.get("deepspeed")]
    if ds:
        out += ["", f"DeepSpeed {res['peers']['deepspeed']} `DistributedAttention` (Ulysses) on the same shards:", ""]
        out.append("| case | fwd bytes | bwd bytes | ratio vs orig-heads theory | max abs diff vs seqpar |")
        out.append("|---|---:|---:|---:|---:|")
        for c in ds:
            d = c["deepspeed"]
            if "error" in d:
                out.append(f"| {_case_label(c)} | - | - | fails: `{d['error']}` | - |")
            else:
                mb = d["measured_bytes"]
                out.append(
                    f"| {_case_label(c)} | {mb['fwd']:,} | {mb['bwd']:,} | {d['ratio_vs_original_heads']['fwd']:.3f} "
                    f"| {d['max_abs_diff_vs_seqpar_out_and_grads']:.1e} |"
                )
    out += ["", "### Causal load balance (forward FLOPs per ring rank, from the ring's piece plan)", ""]
    pl = res["load_balance"]["planned"]
    out.append(f"S={pl['seq_len']}, H={pl['heads']}, D={pl['head_dim']}.")
    out.append("")
    out.append("| R | layout | max/mean | (2R-1)/R | per-rank GFLOP |")
    out.append("|---:|---|---:|---:|---|")
    for r in pl["rows"]:
        per = ", ".join(f"{f / 1e9:.2f}" for f in r["flops_per_rank"])
        out.append(
            f"| {r['ring_degree']} | {r['layout']} | {r['max_over_mean']:.3f} | "
            f"{(2 * r['ring_degree'] - 1) / r['ring_degree']:.3f} | {per} |"
        )
    m = res["load_balance"]["measured"]
    out += [
        "",
        f"Measured at R=4, S={m['seq_len']}, H={m['heads']}, D={m['head_dim']}, fp32, forward, median of {m['reps']}:",
        "",
    ]
    out.append(
        "| layout | kernel CPU s per rank | max/mean CPU | predicted per rank (from shapes) | max/mean predicted "
        "| max/mean executed FLOPs | kernel calls per rank |"
    )
    out.append("|---|---|---:|---|---:|---:|---|")
    for layout, v in m["layouts"].items():
        cpu = ", ".join(f"{x:.3f}" for x in v["kernel_cpu_s_per_rank"])
        pr = ", ".join(f"{x:.3f}" for x in v["predicted_kernel_cpu_s_per_rank"])
        out.append(
            f"| {layout} | {cpu} | {v['max_over_mean_cpu']:.3f} | {pr} | {v['predicted_max_over_mean_cpu']:.3f} | "
            f"{v['max_over_mean_flops']:.3f} | {v['kernel_calls_per_rank']} |"
        )
    out += ["", "Kernel CPU time per piece shape (one process, 1 thread; FLOPs: causal counts half):", ""]
    out.append("| q len | kv len | causal | CPU ms | ns per FLOP |")
    out.append("|---:|---:|---|---:|---:|")
    for sh in m["kernel_shape_cpu_s"]:
        area = sh["q_len"] * (sh["q_len"] + 1) / 2 if sh["causal"] else sh["q_len"] * sh["kv_len"]
        fl = 4.0 * m["heads"] * m["head_dim"] * area
        out.append(
            f"| {sh['q_len']} | {sh['kv_len']} | {sh['causal']} | {sh['cpu_s'] * 1e3:.2f} | "
            f"{sh['cpu_s'] / fl * 1e9:.3f} |"
        )
    t = res["timing"]
    out += [
        "",
        f"### Time, S={t['seq_len']}, B=1, H={t['heads']}, D={t['head_dim']}, fp32, causal, "
        f"P={t['sp_size']} (1 thread per rank) vs one process (1 thread): median of {t['reps']}, "
        "best = fastest repeat",
        "",
    ]
    out.append(
        "| run | fwd s | bwd s | fwd+bwd s | wall speedup | best fwd+bwd s | best-rep speedup "
        "| CPU s slowest rank | CPU s all ranks | CPU speedup |"
    )
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    for name, v in t["results"].items():
        sp = t["speedup_vs_single_process"].get(name)
        bs = t["best_rep_speedup_vs_single_process"].get(name)
        cs = t["cpu_speedup_vs_single_process"].get(name)
        out.append(
            f"| {name} | {v['median_fwd_s']:.3f} | {v['median_bwd_s']:.3f} | {v['median_total_s']:.3f} | {x(sp)} "
            f"| {v['min_total_s']:.3f} | {x(bs)} | {v['median_cpu_s_max_rank']:.3f} | "
            f"{v['median_cpu_s_sum_ranks']:.3f} | {x(cs)} |"
        )
    out += _vs_deepspeed_lines(t)
    mc = res["machine"]
    out += [
        "",
        f"Machine: {mc['cpu_count']} CPUs, {mc['processor']}, torch {mc['torch']}; load average (1 min) "
        f"start {mc['loadavg_start'][0]:.2f}, end {mc['loadavg_end'][0]:.2f}, during timing "
        f"{', '.join(f'{x:.2f}' for x in t['loadavg_1min_during'])}. Total {res['elapsed_s']:.0f} s.",
    ]
    return out


def _vs_deepspeed_lines(t: dict[str, Any]) -> list[str]:
    """seqpar Ulysses / DeepSpeed Ulysses ratios (same run, same shards) and the profile table."""
    out: list[str] = []
    res = t["results"]
    if "deepspeed_ulysses" in res:
        ds = res["deepspeed_ulysses"]
        out += ["", "seqpar / DeepSpeed Ulysses, same run and shards (median fwd+bwd wall; median CPU s summed "
                "over ranks):", "", "| seqpar run | wall ratio | best-rep wall ratio | CPU ratio (sum of ranks) |",
                "|---|---:|---:|---:|"]
        for name in ("ulysses", "ulysses_overlap2"):
            v = res[name]
            out.append(f"| {name} | {v['median_total_s'] / ds['median_total_s']:.3f} | "
                       f"{v['min_total_s'] / ds['min_total_s']:.3f} | "
                       f"{v['median_cpu_s_sum_ranks'] / ds['median_cpu_s_sum_ranks']:.3f} |")
    out += _kernel_bound_lines(t.get("kernel_bound"))
    prof = t.get("profile_s") or {}
    if prof:
        cats = sorted({c for p in prof.values() for c in p})
        out += ["", "Where one fwd+bwd's time goes (torch.profiler self time, s, max over ranks; python_and_wait = "
                "autograd Functions, Python glue and waiting on the peer):", "",
                "| category | " + " | ".join(prof) + " |", "|---|" + "---:|" * len(prof)]
        out += [f"| {c} | " + " | ".join(f"{p.get(c, 0.0):.3f}" for p in prof.values()) + " |" for c in cats]
    return out


def _kernel_bound_lines(kb: dict[str, Any] | None) -> list[str]:
    """The kernel's rate against a matmul's, and each profiled run's kernel share (the glue-free floor)."""
    if not kb:
        return []
    r, out = kb["kernel_rate"], []
    if r:
        s = r["shape"]
        out += ["", f"The CPU flash kernel alone at one Ulysses rank's shape ({s['heads']} heads x {s['seq_len']} x "
                f"{s['head_dim']}, fp32, causal, {r['threads']} thread, best of {r['reps']}): fwd "
                f"{r['fwd_gflops']:.1f}, bwd {r['bwd_gflops']:.1f}, fwd+bwd {r['fwd_bwd_gflops']:.1f} useful GFLOP/s = "
                f"{r['fraction_of_matmul']:.2f} x this thread's fp32 matmul ({r['matmul_size']}^2: "
                f"{r['matmul_gflops']:.1f} GFLOP/s)."]
    floors = kb["cpu_ratio_floor"]
    if floors:
        out += ["", "Kernel share of each profiled fwd+bwd (self s): the CPU ratio against that run which the same "
                "kernel with no glue at all would give:", "", "| run | kernel s | glue s | kernel share (floor) |",
                "|---|---:|---:|---:|"]
        out += [f"| {m} | {f['kernel_s']:.3f} | {f['glue_s']:.3f} | {f['floor']:.3f} |" for m, f in floors.items()]
    return out


def plot_attention(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))

    ax = axes[0]
    cases = res["comm_bytes"]["cases"]
    labels = [_case_label(c) for c in cases]
    xs = range(len(cases))
    for off, key, name in (
        (-0.2, "ratio_vs_original_heads", "vs original heads"),
        (0.2, "ratio_vs_plan_heads", "vs head-plan heads"),
    ):
        vals = [(c[key]["fwd"] + c[key]["bwd"]) / 2 for c in cases]
        ax.bar([x + off for x in xs], vals, width=0.4, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("measured / theory bytes (mean of fwd, bwd)")
    ax.set_title("Comm bytes per rank vs theory")
    ax.legend(fontsize=8)

    ax = axes[1]
    rows = res["load_balance"]["planned"]["rows"]
    for layout, mk in (("contiguous", "o-"), ("zigzag", "s-")):
        rs = [r["ring_degree"] for r in rows if r["layout"] == layout]
        ax.plot(rs, [r["max_over_mean"] for r in rows if r["layout"] == layout], mk, label=f"{layout} (plan)")
    meas = res["load_balance"]["measured"]
    for layout, mk, col in (("contiguous", "o", "C0"), ("zigzag", "s", "C1")):
        ax.plot(
            [meas["ring_degree"]],
            [meas["layouts"][layout]["max_over_mean_cpu"]],
            mk,
            color=col,
            mfc="none",
            ms=12,
            label=f"{layout}: measured kernel CPU time, R=4",
        )
        ax.plot(
            [meas["ring_degree"] + 0.15],
            [meas["layouts"][layout]["predicted_max_over_mean_cpu"]],
            "x",
            color=col,
            ms=10,
            label=f"{layout}: predicted from per-shape kernel time",
        )
    ax.set_xlabel("ring degree R")
    ax.set_ylabel("max / mean per-rank causal attention work")
    ax.set_title("Causal load balance")
    ax.legend(fontsize=8)

    ax = axes[2]
    t = res["timing"]
    names = list(t["results"])
    xs = list(range(len(names)))
    fwd = [t["results"][n]["median_fwd_s"] for n in names]
    bwd = [t["results"][n]["median_bwd_s"] for n in names]
    cpu = [t["results"][n]["median_cpu_s_max_rank"] for n in names]
    ax.bar([x - 0.2 for x in xs], fwd, width=0.4, label="wall fwd")
    ax.bar([x - 0.2 for x in xs], bwd, width=0.4, bottom=fwd, label="wall bwd")
    ax.bar([x + 0.2 for x in xs], cpu, width=0.4, color="C2", hatch="//", label="CPU s, slowest rank (fwd+bwd)")
    ax.set_xticks(xs, names, fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"fwd+bwd, S={t['seq_len']}, P={t['sp_size']} vs 1 process (fp32, 1 thread each)")
    ax.legend(fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step(res: dict[str, Any], path: str) -> None:
    """Step benchmark: tokens/s at SP=1 and SP=2 per (fine-tuning, features), ratio on top of each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(res["sp2_over_sp1_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, key in enumerate(keys):
        t1, t2 = (res["points"][f"{key}/sp{sp}"]["tokens_per_s"] for sp in (1, 2))
        ax.bar(i - 0.2, t1, 0.4, color="tab:gray", label="SP=1" if i == 0 else None)
        ax.bar(i + 0.2, t2, 0.4, color="tab:blue", label="SP=2" if i == 0 else None)
        ax.text(i + 0.2, t2, f"{res['sp2_over_sp1_tokens_per_s'][key]:.2f}x", ha="center", va="bottom")
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel("tokens / s (best step)")
    ax.set_title(f"SFT step, S={res['seq_len']}, {res['model']['arch']}, 1 thread/rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
