"""Render the benchmark JSON: the attention benchmark's markdown summary (each part's tables are rendered next to
the code that writes that part: bench/attention/comm.py, balance.py, timing.py) and its 3-panel PNG; the step
benchmark's PNG (used for docs/benchmarks.md)."""

from __future__ import annotations

from typing import Any

from .attention.balance import balance_lines
from .attention.comm import case_label, comm_lines
from .attention.driver import machine_lines
from .attention.timing import timing_lines

__all__ = ["plot_attention", "plot_peers", "plot_step", "summary_lines"]


def summary_lines(res: dict[str, Any]) -> list[str]:
    """Markdown tables of the attention benchmark's three parts and the machine line."""
    return [*comm_lines(res["comm_bytes"], res["peers"]["deepspeed"]), *balance_lines(res["load_balance"]),
            *timing_lines(res["timing"]), *machine_lines(res)]


def plot_attention(res: dict[str, Any], path: str) -> None:
    """Comm bytes vs theory, causal load balance, fwd+bwd time: one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    _comm_panel(axes[0], res["comm_bytes"])
    _balance_panel(axes[1], res["load_balance"])
    _timing_panel(axes[2], res["timing"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _comm_panel(ax: Any, section: dict[str, Any]) -> None:
    cases = section["cases"]
    labels = [case_label(c) for c in cases]
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


def _balance_panel(ax: Any, section: dict[str, Any]) -> None:
    rows = section["planned"]["rows"]
    for layout, mk in (("contiguous", "o-"), ("zigzag", "s-")):
        rs = [r["ring_degree"] for r in rows if r["layout"] == layout]
        ax.plot(rs, [r["max_over_mean"] for r in rows if r["layout"] == layout], mk, label=f"{layout} (plan)")
    meas = section["measured"]
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


def _timing_panel(ax: Any, t: dict[str, Any]) -> None:
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


def plot_peers(res: dict[str, Any], path: str) -> None:
    """`--peers`: per case, seqpar / peer for the per-rank peak, the checkpointed peak and the CPU seconds (one bar
    per pair that both ran; 1.0 = parity, below = seqpar needs less)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = res["side_by_side"]["cases"]
    metrics = (("peak_bytes", "per-rank peak"), ("checkpointed_peak_bytes", "checkpointed peak"),
               ("median_cpu_s", "CPU s, slowest rank"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(18, 5.5), sharey=True)
    pairs = sorted({p for c in cases for p in c["ratios"]})
    width = 0.8 / max(1, len(pairs))
    for ax, (key, title) in zip(axes, metrics):
        for j, pair in enumerate(pairs):
            xs = [i + (j - (len(pairs) - 1) / 2) * width for i in range(len(cases))]
            ys = [(c["ratios"].get(pair) or {}).get(key) or 0.0 for c in cases]
            ax.bar(xs, ys, width, label=pair)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(cases)), [c["label"].replace(" heads", "") for c in cases], rotation=30, ha="right",
                      fontsize=8)
        ax.set_title(f"seqpar / peer: {title}")
        ax.set_ylim(0, 1.35)
    axes[0].set_ylabel("ratio (below 1: seqpar less); missing bar: a side refused")
    axes[0].legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
