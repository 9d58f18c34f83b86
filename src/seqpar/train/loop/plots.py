"""Loss-curve PNGs (matplotlib, headless) and metrics JSONL reading."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_metrics", "plot_curves"]


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl merged per step (a train row and its eval row become one); a later value for
    the same step and key (a resumed run) replaces the earlier one."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                by_step.setdefault(int(row["step"]), {}).update(row)
    return [by_step[k] for k in sorted(by_step)]


def plot_curves(curves: dict[str, list[tuple[int, float]]], out_png: str | Path, title: str = "training loss",
                ylabel: str = "loss", diff_of: tuple[str, str] | None = None) -> Path:
    """One line per named curve of (step, value); with `diff_of=(a, b)` a lower panel shows |a - b|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    rows = 2 if diff_of else 1
    fig, axes = plt.subplots(rows, 1, figsize=(7, 3.2 * rows + 0.6), squeeze=False, sharex=True)
    ax = axes[0][0]
    styles = ["-o", "--x", ":s", "-.^"]
    for i, (name, pts) in enumerate(curves.items()):
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, styles[i % len(styles)], label=name, markersize=4, linewidth=1.4)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8, framealpha=0.85)  # inside the axes, where the curves leave room
    if diff_of:
        a, b = (dict(curves[k]) for k in diff_of)
        steps = sorted(set(a) & set(b))
        d = [abs(a[s] - b[s]) for s in steps]
        ax2 = axes[1][0]
        ax2.plot(steps, [max(x, 1e-12) for x in d], "-o", color="tab:red", markersize=3)
        ax2.set_yscale("log")
        ax2.set_ylabel("|loss difference|")
        ax2.set_title(f"max |dloss| = {max(d):.2e}" if d else "", fontsize=9)
        ax2.grid(alpha=0.3)
        ax2.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    from matplotlib.ticker import MaxNLocator

    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
