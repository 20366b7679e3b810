"""The figures of ``flatzero bench doors``: per launch (the slowest rank), per run (medians
over trials, paired flatzero / DeepSpeed ratios) and over runs (their spread)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = [
    "METRICS",
    "RATIOS",
    "loss_diff",
    "slowest_rank",
    "spread",
    "summarize_run",
    "summarize_runs",
]

METRICS = (
    "init_s",
    "first_step_s",
    "ttfs_s",
    "bwd_s",
    "step_s",
    "init_cpu_s",
    "init_cpu_share",
    "ttfs_cpu_share",
)
"""Per-launch figures of a door (slowest rank): init, first step, init + first step,
the first step's ``engine.backward`` and ``engine.step`` (seconds; on the rank where each
took longest, waits for other ranks included), CPU seconds of init per rank, and CPU
seconds / (wall x cores per rank) of init and of init + first step."""

RATIOS = ("init_s", "first_step_s", "ttfs_s", "bwd_s", "step_s")
"""The figures compared as flatzero / DeepSpeed."""


def slowest_rank(record: dict[str, Any]) -> dict[str, float]:
    """One door launch's figures (``METRICS``) on its slowest rank.

    ``record`` is a ``door_trial`` result: ``{"ranks": [{"init_s", "ttfs_s", "init_cpu_s",
    "ttfs_cpu_s", "threads", ...}, ...]}``. The first step is the longest time to first
    step minus the longest init (a rank that finished its init first waits for the others
    in the step's collectives; that wait is not the step's).
    """
    ranks = record["ranks"]
    init = max(r["init_s"] for r in ranks)
    ttfs = max(r["ttfs_s"] for r in ranks)
    return {
        "init_s": init,
        "first_step_s": ttfs - init,
        "ttfs_s": ttfs,
        "bwd_s": max(r["bwd_s"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "init_cpu_s": max(r["init_cpu_s"] for r in ranks),
        "init_cpu_share": max(r["init_cpu_s"] / (r["init_s"] * r["threads"]) for r in ranks),
        "ttfs_cpu_share": max(r["ttfs_cpu_s"] / (r["ttfs_s"] * r["threads"]) for r in ranks),
    }


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"min", "median", "max", "values"}`` of ``values`` (non-empty)."""
    if not values:
        raise ValueError("spread() of no values")
    vals = list(values)
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "values": vals}


def summarize_run(
    trials: dict[str, list[dict[str, float]]], limit_s: float | None
) -> dict[str, Any]:
    """One run's figures: per door the median over its trials of each metric, per door
    ``x_limit`` (median init / first-touch limit), and with both doors the median over
    trials of each trial's flatzero / DeepSpeed ratio (the two launches of a trial are
    neighbours, so their ratio is the least disturbed by the machine's drift).

    Args:
        trials: door -> its trials' ``slowest_rank`` figures, in trial order (the doors
            have the same number of trials; trial i of each door is a pair).
        limit_s: this run's first-touch limit in seconds (slowest rank), or None.
    """
    out: dict[str, Any] = {"doors": {}}
    for door, figures in trials.items():
        med = {m: statistics.median(f[m] for f in figures) for m in METRICS}
        med["x_limit"] = med["init_s"] / limit_s if limit_s else None
        out["doors"][door] = med
    out["limit_s"] = limit_s
    if "flatzero" in trials and "deepspeed" in trials:
        pairs = list(zip(trials["flatzero"], trials["deepspeed"], strict=True))
        out["ratio"] = {m: statistics.median(f[m] / d[m] for f, d in pairs) for m in RATIOS}
    else:
        out["ratio"] = None
    return out


def summarize_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The spread over runs (``spread``) of every figure of ``summarize_run``."""
    doors = runs[0]["doors"]
    out: dict[str, Any] = {
        "doors": {
            door: {
                key: spread([r["doors"][door][key] for r in runs])
                for key in doors[door]
                if all(r["doors"][door][key] is not None for r in runs)
            }
            for door in doors
        },
        "limit_s": (
            spread([r["limit_s"] for r in runs])
            if all(r["limit_s"] is not None for r in runs)
            else None
        ),
        "ratio": (
            {m: spread([r["ratio"][m] for r in runs]) for m in RATIOS}
            if runs[0]["ratio"] is not None
            else None
        ),
    }
    return out


def loss_diff(runs: Sequence[dict[str, Any]]) -> float | None:
    """Largest |flatzero - deepspeed| first-step loss over trials and ranks (None with one
    door): the same model and batch through either door give the same first forward."""
    pairs = [
        (a, b)
        for r in runs
        if {"flatzero", "deepspeed"} <= set(r["loss"])
        for a, b in zip(r["loss"]["flatzero"], r["loss"]["deepspeed"], strict=True)
    ]
    return max((abs(a - b) for a, b in pairs), default=None)
