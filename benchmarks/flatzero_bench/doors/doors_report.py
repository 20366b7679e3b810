"""What ``flatzero bench doors`` shows: its header, its table and its plot."""

from __future__ import annotations

import argparse
from typing import Any

from flatzero_bench.common.machine import usable_cores

__all__ = ["header", "plot", "table"]

_ROWS = (
    ("init s", "init_s", "init_s"),
    ("first step s", "first_step_s", "first_step_s"),
    ("init + 1st step s", "ttfs_s", "ttfs_s"),
    ("  1st step: backward s", "bwd_s", "bwd_s"),
    ("  1st step: engine.step s", "step_s", "step_s"),
    ("init / 1st-touch limit", "x_limit", None),
    ("init CPU s per rank", "init_cpu_s", None),
    ("init CPU / (wall x cores)", "init_cpu_share", None),
    ("ttfs CPU / (wall x cores)", "ttfs_cpu_share", None),
)
"""Table rows: label, the door figure, the ratio shown beside it (None: no ratio)."""


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _spread_text(s: dict[str, Any] | None) -> str:
    if s is None:
        return "-"
    return f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}"


def header(
    args: argparse.Namespace, info: dict[str, Any], machine: dict[str, Any], seconds: float
) -> str:
    """The lines above the table: the model (``info``: params, tensors, bf16 bytes), the
    settings, the run's ``seconds``, and the machine and its load (``describe_host``)."""
    cores = usable_cores()
    load_before, load_after = machine["load_average_before"][0], machine["load_average_after"][0]
    text = (
        f"model {args.model}: {info['params'] / 1e9:.3f}B params in {info['tensors']} tensors, "
        f"{info['model_bytes'] / 2**30:.2f} GiB bf16; ZeRO-{args.stage}; {cores} cores, "
        f"OMP_NUM_THREADS = cores // ranks; first step on 1 x {args.seq} tokens; "
        f"{args.runs} run(s) x {args.trials} trial(s) per door; {seconds:.0f} s in all"
        f"\n{machine['node']}: {machine['cpu']}, torch {machine['torch']}, deepspeed "
        f"{machine.get('deepspeed', '-')}; 1-min load average {load_before:.1f} before, "
        f"{load_after:.1f} after"
    )
    if max(load_before, load_after) > cores:
        text += f" (above {cores}: other work shared the cores, the figures are disturbed)"
    return text


def _group_lines(g: dict[str, Any], doors: tuple[str, ...], both: bool) -> list[str]:
    """One mode and world size: a line per ``_ROWS`` entry, the limit, the loss check."""
    sp = g["spread"]
    lines = []
    for i, (label, key, ratio_key) in enumerate(_ROWS):
        cells = []
        for d in doors:
            s = sp["doors"][d].get(key)
            cells.append(f"{_fmt(s['median'] if s else None):>10}")
        ratio = ""
        if both:
            ratio = "  " + (_spread_text(sp["ratio"][ratio_key]) if ratio_key else "")
        first = i == 0
        lines.append(
            f"{g['mode'] if first else '':<14} {g['world_size'] if first else '':>5} "
            f"{label:<26} " + " ".join(cells) + ratio
        )
    lines.append(
        f"{'':<14} {'':>5} limit: first touch of {g['must_write_bytes'] / 2**30:.2f} GiB "
        f"per rank, {g['threads']} thread(s): {_spread_text(sp['limit_s'])} s (min / median / max)"
    )
    if g["loss_max_abs_diff"] is not None:
        lines.append(
            f"{'':<14} {'':>5} first-step loss, flatzero vs deepspeed (same model and "
            f"batch): max |difference| {g['loss_max_abs_diff']:.3g}"
        )
    return lines


def table(groups: list[dict[str, Any]], doors: tuple[str, ...]) -> str:
    """Per mode and world size: each door's median over runs of its per-run medians, and
    the spread over runs of the per-run median flatzero / DeepSpeed ratio."""
    both = "deepspeed" in doors and "flatzero" in doors
    head = (
        f"{'mode':<14} {'ranks':>5} {'figure':<26} "
        + " ".join(f"{d:>10}" for d in doors)
        + (f"  {'flatzero / deepspeed per run: min / median / max':<50}" if both else "")
    )
    lines = [head, "-" * len(head)]
    for g in groups:
        lines.extend(_group_lines(g, doors, both))
    return "\n".join(lines)


def _bars(ax: Any, mine: list[dict[str, Any]], doors: tuple[str, ...]) -> None:
    """One mode's bars: per world size, each door's init and init + first step (median of
    runs, min-max whiskers), and the first-touch limit as a dashed line."""
    series = [(d, key) for key in ("init_s", "ttfs_s") for d in doors]
    colors = {"flatzero": "tab:green", "deepspeed": "tab:gray"}
    width = 0.8 / len(series)
    for j, (door, key) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, g in enumerate(mine):
            s = g["spread"]["doors"][door][key]
            xs.append(i + (j - (len(series) - 1) / 2) * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        label = f"{door} {'init' if key == 'init_s' else 'init + 1st step'}"
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=label,
               color=colors.get(door, "tab:blue"),
               alpha=1.0 if key == "init_s" else 0.5)  # fmt: skip
    for i, g in enumerate(mine):
        lim = g["spread"]["limit_s"]
        if lim is not None:
            ax.hlines(lim["median"], i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                      label="first-touch limit" if i == 0 else None)  # fmt: skip


def plot(path: str, groups: list[dict[str, Any]], doors: tuple[str, ...], title: str) -> bool:
    """Draw one panel per mode to ``path``; False (nothing drawn) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = list(dict.fromkeys(g["mode"] for g in groups))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        mine = [g for g in groups if g["mode"] == mode]
        _bars(ax, mine, doors)
        ax.set_xticks(range(len(mine)), [f"{g['world_size']} rank(s)" for g in mine])
        ax.set_ylabel("seconds, slowest rank (median of runs; bars: min-max)")
        ax.set_title(mode)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
