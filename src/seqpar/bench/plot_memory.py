"""Render the memory benchmark JSON: per model, peak vs S_local (one line per SP x feature set, with the
per-rank budget) and the predicted max full length under the budget (bars per SP, one per feature set)."""

from __future__ import annotations

from typing import Any

__all__ = ["plot_memory"]

_STYLES = {1: "-", 2: "--", 4: ":"}


def plot_memory(res: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(res["models"].items())
    fsets = list(res["feature_sets"])
    colors = {fs: f"C{i}" for i, fs in enumerate(fsets)}
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.6 * len(models)), squeeze=False)
    for row, (name, m) in enumerate(models):
        ax = axes[row][0]
        for sp in m["sp_sizes"]:
            for fs in fsets:
                pts = sorted((p for p in m["points"] if p["sp"] == sp and p["feature_set"] == fs),
                             key=lambda p: p["s_local"])
                ax.plot([p["s_local"] for p in pts], [p["peak_bytes"] / 2**20 for p in pts], _STYLES.get(sp, "-."),
                        marker="o", color=colors[fs], label=f"SP={sp} {fs}")
                if any(p.get("offloaded_peak_bytes") for p in pts):  # activation offload: the host store's peak
                    ax.plot([p["s_local"] for p in pts], [p["offloaded_peak_bytes"] / 2**20 for p in pts],
                            _STYLES.get(sp, "-."), marker="x", color=colors[fs], alpha=0.5,
                            label=f"SP={sp} {fs} (host)")
        ax.set_xlabel("S_local (tokens per rank)")
        ax.set_ylabel("peak per rank (MiB, exact tensor bytes; device, x = host store)")
        ax.set_title(f"{name}: peak vs S_local")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        ax = axes[row][1]
        width = 0.8 / len(fsets)
        for i, fs in enumerate(fsets):
            vals = [m["max_length"][f"sp{sp}/{fs}"]["max_full_length"] or 0 for sp in m["sp_sizes"]]
            ax.bar([j + i * width for j in range(len(vals))], vals, width, color=colors[fs], label=fs)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(m["sp_sizes"]))])
        ax.set_xticklabels([f"SP={sp}" for sp in m["sp_sizes"]])
        ax.set_ylabel("max full length (tokens, from the fit)")
        ax.set_title(f"{name}: max trainable length at {res['budget_gib']:g} GiB per rank")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
