"""Plot `flatzero bench offload --json` results: one panel per part found in them.

Usage: python benchmarks/plot_offload.py OUT.png RESULT.json [RESULT.json ...]

kernel: ms per AdamW step per method and thread count; step: ms per whole step per method
and world size; init: init seconds per door and world size (median over launches, the
launches as dots); memory: per world size, what the plan states (offload's host bytes,
the staging and padding, backward's moment: autograd's largest gradient) stacked, beside
the resident set measured settled and at the step's and backward's peaks.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _bars(
    ax, groups: list[str], series: dict[str, list[float | None]], ylabel: str, fmt: str = "%.0f"
) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + i * width for j, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt=fmt, fontsize=6)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def _kernel(ax, part: dict) -> None:
    rows = part["rows"]
    threads = list(dict.fromkeys(r["threads"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    series = {
        m: [
            next((r["step_s_median"] * 1e3 for r in rows if r["method"] == m and r["threads"] == t),
                 None)
            for t in threads
        ]
        for m in methods
    }  # fmt: skip
    _bars(ax, [f"{t} thread(s)" for t in threads], series, "ms per step (median)")
    ax.set_yscale("log")
    ax.set_title(f"AdamW over {part['numel'] / 1e6:.0f}M fp32", fontsize=9)


def _step(ax, part: dict) -> None:
    rows = part["summary"]
    sizes = list(dict.fromkeys(r["world_size"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    series = {
        m: [
            next((r["total_s"] * 1e3 for r in rows if r["method"] == m and r["world_size"] == w),
                 None)
            for w in sizes
        ]
        for m in methods
    }  # fmt: skip
    _bars(ax, [f"{w} rank(s)" for w in sizes], series, "ms per whole step (median)")
    ax.set_title(f"step, {part['spec']['model']} {part['spec']['dtype']}", fontsize=9)


def _init(ax, part: dict) -> None:
    rows = part["rows"]
    sizes = list(dict.fromkeys(r["world_size"] for r in rows))
    doors = list(dict.fromkeys(r["door"] for r in rows))
    series = {
        d: [
            next((r["init_s"] for r in rows if r["door"] == d and r["world_size"] == w), None)
            for w in sizes
        ]
        for d in doors
    }
    _bars(ax, [f"{w} rank(s)" for w in sizes], series, "init s (median; dots: launches)", "%.1f")
    width = 0.8 / len(doors)
    for i, d in enumerate(doors):
        for j, w in enumerate(sizes):
            row = next((r for r in rows if r["door"] == d and r["world_size"] == w), None)
            if row:
                ax.plot([j + i * width] * len(row["init_s_all"]), row["init_s_all"], "k.", ms=3)
    ax.set_title(f"init with offload, {part['model']}", fontsize=9)


def _memory(ax, part: dict) -> None:
    gib = 2**30
    rows = part["rows"]
    xs = range(len(rows))
    plan = [r["formula"]["total"] / gib for r in rows]
    other = [r["other_bytes"] / gib for r in rows]
    moment = [r.get("largest_gradient_bytes", 0) / gib for r in rows]
    ax.bar([x - 0.3 for x in xs], plan, 0.2, label="plan: offload host bytes")
    ax.bar([x - 0.3 for x in xs], other, 0.2, bottom=plan, label="+ staging, padding")
    below = [a + b for a, b in zip(plan, other, strict=True)]
    ax.bar([x - 0.3 for x in xs], moment, 0.2, bottom=below, label="+ backward's moment")
    phases = [("settled", lambda r: r["rss_gain_bytes"])] + [
        (f"{p} peak", lambda r, p=p: r["phase_peak_gain_bytes"][p]) for p in ("step", "backward")
    ]
    for i, (name, value) in enumerate(phases):
        bars = ax.bar([x - 0.1 + 0.2 * i for x in xs], [value(r) / gib for r in rows], 0.2,
                      label=f"RSS {name}")  # fmt: skip
        ax.bar_label(bars, fmt="%.2f", fontsize=6)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['world_size']} rank(s)" for r in rows])
    ax.set_ylabel("GiB per rank")
    ax.legend(fontsize=6)
    ax.set_title(f"host memory with offload, {part['model']}", fontsize=9)


def main(out: str, paths: list[str]) -> None:
    parts = []
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for name, draw in (
            ("kernel", _kernel),
            ("step", _step),
            ("init", _init),
            ("memory", _memory),
        ):
            if name == "memory" and not all(
                r.get("phase_peak_gain_bytes") for r in result.get(name, {}).get("rows", [{}])
            ):
                continue  # recorded before the phases were: nothing to draw per phase
            if name in result:
                parts.append((draw, result[name]))
    fig, axes = plt.subplots(1, len(parts), figsize=(4.2 * len(parts), 3.8), squeeze=False)
    for ax, (draw, part) in zip(axes[0], parts, strict=True):
        draw(ax, part)
    fig.suptitle("flatzero bench offload (offload_optimizer: cpu), 2-core VM, no GPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
