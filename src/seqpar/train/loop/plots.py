"""Loss-curve PNGs (matplotlib, headless) and metrics JSONL reading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_metrics", "plot_curves", "curves_figure", "diff_title"]


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
                ylabel: str = "loss", diff_of: tuple[str, str] | None = None, tolerance: float | None = None) -> Path:
    """One line per named curve of (step, value); with `diff_of=(a, b)` a lower panel shows |a - b| on a log scale,
    with a dashed line at `tolerance` and exact zeros drawn as marked points at the panel's bottom (and said so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig = curves_figure(curves, title, ylabel, diff_of, tolerance)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def curves_figure(curves: dict[str, list[tuple[int, float]]], title: str = "training loss", ylabel: str = "loss",
                  diff_of: tuple[str, str] | None = None, tolerance: float | None = None) -> Any:
    """The matplotlib figure `plot_curves` saves (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
        _diff_panel(axes[1][0], steps, [abs(a[s] - b[s]) for s in steps], tolerance)
    else:
        ax.set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def diff_title(d: list[float], tolerance: float | None) -> str:
    """The |dloss| panel's title: the largest difference, how many steps are exactly 0, the tolerance."""
    tol = f"; tolerance {tolerance:.0e}" if tolerance is not None else ""
    zeros = sum(1 for x in d if x == 0)
    if d and zeros == len(d):
        return f"|dloss| = 0 exactly at every step (identical losses){tol}"
    zero = f"; exactly 0 at {zeros} of {len(d)} steps (marked at the bottom)" if zeros else ""
    return (f"max |dloss| = {max(d):.2e}" if d else "") + zero + tol


def _diff_panel(ax: Any, steps: list[int], d: list[float], tolerance: float | None) -> None:
    """|dloss| per step on a log scale; a log axis has no 0, so exact zeros are marked points at the bottom."""
    nonzero = [x for x in d if x > 0]
    floor = min(nonzero + ([tolerance] if tolerance else [])) / 100 if nonzero or tolerance else 1e-12
    pts = [(s, x) for s, x in zip(steps, d) if x > 0]
    if pts:
        ax.plot(*zip(*pts), "-o", color="tab:red", markersize=3, label="|dloss|")
    zeros = [s for s, x in zip(steps, d) if x == 0]
    if zeros:
        ax.plot(zeros, [floor] * len(zeros), "v", color="tab:green", markersize=6, label="exactly 0 (no difference)")
    if tolerance is not None and tolerance > 0:
        ax.axhline(tolerance, color="gray", linestyle="--", linewidth=1.0, label=f"tolerance {tolerance:.0e}")
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor / 3)
    ax.set_ylabel("|loss difference|")
    ax.set_title(diff_title(d, tolerance), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8, framealpha=0.85)
    ax.set_xlabel("step")
