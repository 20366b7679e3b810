"""Plot a `flatzero bench init --json` result: init time per method and world size.

Usage: python benchmarks/plot_init.py RESULT.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(result: dict, out: str) -> None:
    """Grouped bars: seconds per method, one group per world size, the limits as lines."""
    rows = result["rows"]
    sizes = sorted({r["world_size"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, method in enumerate(methods):
        xs, ys = [], []
        for j, ws in enumerate(sizes):
            row = next((r for r in rows if r["world_size"] == ws and r["method"] == method), None)
            if row:
                xs.append(j + i * width)
                ys.append(row["wall_s"])
        bars = ax.bar(xs, ys, width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    styles = {"copy": "--", "first_touch": ":"}
    for j, ws in enumerate(sizes):
        for key, limit in result["limits"][str(ws)].items():
            ax.hlines(
                limit["seconds"],
                j - width / 2,
                j + 0.8 - width / 2,
                colors="k",
                linestyles=styles[key],
                label=limit["kind"] if j == 0 else None,
            )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{ws} rank(s)" for ws in sizes])
    ax.set_ylabel("init seconds (flatten + fp32 master), slowest rank")
    model = result["model"]
    ax.set_title(
        f"{result['spec']['model']}: {model['params'] / 1e9:.2f}B params, "
        f"{result['spec']['dtype']}, {result['machine']['device']}, "
        f"{result['spec']['settle_s']:g} s settle before each trial",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
