"""Plot a `flatzero bench device-memory --json` result: device memory at init per method.

Usage: python benchmarks/plot_device_memory.py RESULT.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(result: dict, out: str) -> None:
    """Stacked bars per (world size, params on, method): what stays, and what passes above
    it (the transient), in MiB; the floor as a tick."""
    rows = result["rows"]
    mib = 2**20
    labels, held, transient, floors = [], [], [], []
    for r in rows:
        labels.append(f"{r['world_size']}r {r['params_on']}\n{r['method']}")
        held.append(r["held_after_bytes"] / mib)
        transient.append(r["transient_bytes"] / mib)
        floors.append(r["floor_bytes"] / mib)
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(rows))
    ax.bar(xs, held, color="#4c72b0", label="held after init")
    ax.bar(xs, transient, bottom=held, color="#dd8452", label="transient (peak - held)")
    ax.scatter(xs, floors, marker="_", s=400, color="black", label="floor", zorder=3)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("device MiB above the start")
    spec = result["spec"]
    ax.set_title(f"{spec['model']} ({spec['dtype']}) on {spec['device']}: device memory at init")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        plot(json.load(f), sys.argv[2])
