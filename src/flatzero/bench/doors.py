"""Door against door: flatzero.initialize vs deepspeed.initialize, one torchrun launch each.

Every trial is its own ``torchrun`` job (``python -m torch.distributed.run --standalone
--nproc-per-node N -m flatzero.bench.door_trial``), a fresh process per rank as at a
job's start, of one script that builds the model (from a seed, bf16, on the host) and
calls ``flatzero.initialize`` or ``deepspeed.initialize`` with the same DeepSpeed config
(ZeRO-2 by default, bf16, ``gradient_clipping`` 1.0, micro-batch 1,
``zero_force_ds_cpu_optimizer: false``) and the same client ``torch.optim.AdamW``, then
takes the first training step on the same random batch (``engine(ids, labels=ids)``,
``engine.backward``, ``engine.step``; ``--seq`` tokens, 2 by default: without AVX-512 the
CPU runs bf16 matmuls in a slow fallback, and the forward and backward, the same work
through either door, would bury what the doors do differently). See ``door_trial`` for
what is timed.

How the launches are arranged:

- the doors alternate, the order rotating from one trial to the next (and from one run
  to the next), so neither is always the one that follows the other's freed memory;
- ``--trials`` such pairs make a run, per mode and world size; ``--runs`` repeats it all,
  the modes and world sizes interleaved, and the table gives the spread of the runs'
  figures (min / median / max of each run's median), not one median: this machine's
  memory state moves every absolute figure, so only ratios of neighbouring launches
  mean much, and how much they move from run to run is part of the result;
- modes (``--settle-s``, comma-separated): ``0`` is back to back, launches following each
  other at once; a positive value pauses that many seconds before every launch so the
  machine has taken freed memory back (a VM's free page reporting returns freed guest
  pages to the host after about 2 s) and every init writes cold memory;
- ``OMP_NUM_THREADS`` is set to cores // ranks for every launch of both doors (torchrun
  would otherwise set 1 for N > 1), and recorded;
- each run ends, per mode and world size, with a launch of the same shape that measures
  the limit: the first touch of the bytes an init must write on a rank (bf16 buckets +
  fp32 master shard + fp32 gradient shard), all ranks at once, each with its share of the
  cores (``limits.first_touch_seconds``, best of ``--limit-repeats``, passes
  ``SETTLE_SECONDS`` apart when settled and back to back otherwise).

Per launch the slowest rank counts: init is the longest ``initialize`` over the ranks,
time to first step (init + first step) the longest from the common barrier to the end
of ``engine.step()``, and the first step the difference of the two. CPU seconds are per
rank (user + system, all threads), set beside wall x the rank's cores (cores // ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .door_trial import DOORS, MARKER, door_config, must_write_bytes
from .init_bench import MODELS
from .limits import SETTLE_SECONDS
from .provenance import command_line, utc_timestamp

__all__ = [
    "METRICS",
    "add_arguments",
    "run",
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


# ------------------------------------------------------------------------ statistics
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


# ------------------------------------------------------------------------ launching
def _cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def _threads(world_size: int) -> int:
    return max(1, _cores() // world_size)


def _launch(
    door: str, world_size: int, args: argparse.Namespace, *, limit_settle_s: float = 0.0
) -> dict[str, Any]:
    """One ``torchrun`` job of ``door_trial``; returns its parsed result line."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world_size),
        "-m", "flatzero.bench.door_trial",
        "--door", door, "--model", args.model, "--stage", str(args.stage),
        "--bucket-numel", str(args.bucket_numel), "--seq", str(args.seq),
        "--seed", str(args.seed), "--limit-repeats", str(args.limit_repeats),
        "--limit-settle-s", str(limit_settle_s),
    ]  # fmt: skip
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(_threads(world_size))
    package_root = str(Path(__file__).resolve().parents[2])  # so the job imports this flatzero
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.launch_timeout_s
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(
            f"{door} at {world_size} rank(s) ran past {args.launch_timeout_s} s: {e}"
        ) from None
    launch_s = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if not lines:
        err = proc.stderr.splitlines()
        shown = err if len(err) <= 60 else [*err[:30], "...", *err[-30:]]  # first error first
        raise RuntimeError(
            f"{door} at {world_size} rank(s) exited {proc.returncode} without a result line: "
            f"{' '.join(cmd)}\n" + "\n".join(proc.stdout.splitlines()[-10:] + shown)
        )
    record = json.loads(lines[-1][len(MARKER) :])
    record["launch_s"] = launch_s
    record["returncode"] = proc.returncode
    if proc.returncode != 0:  # after every rank's result was gathered: at teardown
        _progress(f"warning: {door} at {world_size} rank(s) exited {proc.returncode} after "
                  "its result line; the result is kept")  # fmt: skip
    return record


def _mode_name(settle_s: float) -> str:
    return "back-to-back" if settle_s == 0 else f"settled {settle_s:g}s"


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _run_all(
    args: argparse.Namespace, doors: tuple[str, ...], modes: list[float], sizes: list[int]
) -> tuple[list[dict[str, Any]], dict[tuple[float, int], list[dict[str, Any]]]]:
    """Every launch: warm-up, then runs x modes x world sizes x trials, then a limit."""
    launches: list[dict[str, Any]] = []
    runs: dict[tuple[float, int], list[dict[str, Any]]] = {(m, w): [] for m in modes for w in sizes}
    for ws in sizes:
        for i in range(args.warmup):
            for door in doors:
                rec = _launch(door, ws, args)
                _progress(f"warm-up {i + 1}/{args.warmup}, {ws} rank(s), {door}: "
                          f"init {slowest_rank(rec)['init_s']:.2f} s (untimed)")  # fmt: skip
    for run in range(args.runs):
        for settle in modes:
            for ws in sizes:
                trials: dict[str, list[dict[str, float]]] = {d: [] for d in doors}
                losses: dict[str, list[float]] = {d: [] for d in doors}
                for trial in range(args.trials):
                    shift = (run + trial) % len(doors)
                    for door in doors[shift:] + doors[:shift]:
                        time.sleep(settle)
                        rec = _launch(door, ws, args)
                        fig = slowest_rank(rec)
                        trials[door].append(fig)
                        losses[door].extend(r["loss"] for r in rec["ranks"])
                        rec |= {"run": run, "trial": trial, "settle_s": settle, "slowest": fig}
                        launches.append(rec)
                        _progress(
                            f"run {run + 1}/{args.runs} {_mode_name(settle)} {ws} rank(s) "
                            f"trial {trial + 1}/{args.trials} {door}: init {fig['init_s']:.2f}"
                            f" s, first step {fig['first_step_s']:.2f} s (launch "
                            f"{rec['launch_s']:.0f} s)"
                        )
                time.sleep(settle)
                lim = _launch(
                    "limit", ws, args, limit_settle_s=SETTLE_SECONDS if settle > 0 else 0.0
                )
                limit_s = max(r["limit_s"] for r in lim["ranks"])
                lim |= {"run": run, "settle_s": settle}
                launches.append(lim)
                _progress(
                    f"run {run + 1}/{args.runs} {_mode_name(settle)} {ws} rank(s) limit: "
                    f"first touch of {lim['ranks'][0]['nbytes'] / 2**30:.2f} GiB per rank "
                    f"{limit_s:.2f} s"
                )
                summary = summarize_run(trials, limit_s)
                summary["loss"] = losses  # first-step loss of every trial and rank
                runs[(settle, ws)].append(summary)
    return launches, runs


def compare_back_to_back(
    model: str, world_size: int, *, trials: int = 1, warmup: int = 0
) -> tuple[dict[str, Any], dict[str, str]]:
    """One back-to-back run of the doors (``summarize_run``'s figures, the first-touch
    limit included), as ``flatzero demo`` shows it; and the doors skipped, with why."""
    from .deepspeed_runner import deepspeed_available

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", model, "--world-sizes", str(world_size), "--settle-s", "0",
         "--runs", "1", "--trials", str(trials), "--warmup", str(warmup)]
    )  # fmt: skip
    doors, skipped = DOORS, {}
    ok, why = deepspeed_available()
    if not ok:
        doors, skipped = tuple(d for d in DOORS if d != "deepspeed"), {"deepspeed": why}
    _, runs = _run_all(args, doors, [0.0], [world_size])
    return runs[(0.0, world_size)][0], skipped


# ------------------------------------------------------------------------ output
def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _spread_text(s: dict[str, Any] | None) -> str:
    if s is None:
        return "-"
    return f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}"


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


def _table(groups: list[dict[str, Any]], doors: tuple[str, ...]) -> str:
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
        sp = g["spread"]
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
        lim = sp["limit_s"]
        lines.append(
            f"{'':<14} {'':>5} limit: first touch of {g['must_write_bytes'] / 2**30:.2f} GiB "
            f"per rank, {g['threads']} thread(s): {_spread_text(lim)} s (min / median / max)"
        )
        if g["loss_max_abs_diff"] is not None:
            lines.append(
                f"{'':<14} {'':>5} first-step loss, flatzero vs deepspeed (same model and "
                f"batch): max |difference| {g['loss_max_abs_diff']:.3g}"
            )
    return "\n".join(lines)


def _loss_diff(runs: Sequence[dict[str, Any]]) -> float | None:
    """Largest |flatzero - deepspeed| first-step loss over trials and ranks (None with one
    door): the same model and batch through either door give the same first forward."""
    pairs = [
        (a, b)
        for r in runs
        if {"flatzero", "deepspeed"} <= set(r["loss"])
        for a, b in zip(r["loss"]["flatzero"], r["loss"]["deepspeed"], strict=True)
    ]
    return max((abs(a - b) for a, b in pairs), default=None)


def _plot(path: str, groups: list[dict[str, Any]], doors: tuple[str, ...], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = list(dict.fromkeys(g["mode"] for g in groups))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    series = [(d, key) for key in ("init_s", "ttfs_s") for d in doors]
    colors = {"flatzero": "tab:green", "deepspeed": "tab:gray"}
    width = 0.8 / len(series)
    for ax, mode in zip(axes[0], modes, strict=True):
        mine = [g for g in groups if g["mode"] == mode]
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
        ax.set_xticks(range(len(mine)), [f"{g['world_size']} rank(s)" for g in mine])
        ax.set_ylabel("seconds, slowest rank (median of runs; bars: min-max)")
        ax.set_title(mode)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _machine(load_before: tuple[float, ...]) -> dict[str, Any]:
    import flatzero

    from .step import _cpu_name, _versions

    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "cores_usable": _cores(),
        "cpu": _cpu_name(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "python": platform.python_version(),
        "flatzero": flatzero.__version__,
        **_versions(),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench doors`` options."""
    parser.add_argument("--model", default="llama-0.4b", choices=sorted(MODELS))
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument(
        "--settle-s",
        default="0,6",
        help="modes, comma-separated: seconds to pause before every launch; 0 is back to "
        "back, 6 lets the machine take freed memory back (default: 0,6, both modes)",
    )
    parser.add_argument("--runs", type=int, default=3, help="repeats of the whole alternation")
    parser.add_argument("--trials", type=int, default=3, help="launches per door per run")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed launches of each door per world size first"
    )
    parser.add_argument(
        "--doors", default=",".join(DOORS), help="comma-separated of " + ", ".join(DOORS)
    )
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2], help="ZeRO stage")
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=2**26,
        help="reduce_bucket_size and allgather_bucket_size in the config, elements (even)",
    )
    parser.add_argument(
        "--seq",
        type=int,
        default=2,
        help="tokens in the first step's batch (default 2, one predicted token: a CPU without "
        "AVX-512 runs bf16 matmuls in a slow fallback, and the forward and backward, the same "
        "for both doors, would otherwise bury what the doors do differently)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model init and batch seed")
    parser.add_argument(
        "--limit-repeats", type=int, default=2, help="first-touch passes per limit (best kept)"
    )
    parser.add_argument("--launch-timeout-s", type=float, default=1800)
    parser.add_argument("--json", help="also write the result JSON to this path")
    parser.add_argument("--plot", help="also draw the figures to this image (needs matplotlib)")


def _parse_list(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise SystemExit(f"{what} {text!r} is empty")
    return values


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print progress, a table and one JSON line."""
    from .deepspeed_runner import deepspeed_available

    sizes = _parse_list(args.world_sizes, int, "--world-sizes")
    modes = _parse_list(args.settle_s, float, "--settle-s")
    if any(w < 1 for w in sizes) or any(m < 0 for m in modes):
        raise SystemExit("--world-sizes must be >= 1 and --settle-s >= 0")
    for name in ("runs", "trials", "limit_repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    doors = tuple(d for d in args.doors.split(",") if d)
    if not doors or set(doors) - set(DOORS):
        raise SystemExit(f"--doors {args.doors!r}: choose from {', '.join(DOORS)}")
    skipped: dict[str, str] = {}
    if "deepspeed" in doors:
        ok, why = deepspeed_available()
        if not ok:
            doors = tuple(d for d in doors if d != "deepspeed")
            skipped["deepspeed"] = why
            if not doors:
                raise SystemExit(f"no door left to time: {why}")
    config = door_config(stage=args.stage, bucket_numel=args.bucket_numel)
    load_before = os.getloadavg()
    n = (args.runs * args.trials * len(doors) + args.runs) * len(modes) * len(sizes)
    _progress(
        f"flatzero bench doors: {args.model}, doors {', '.join(doors)}, world sizes "
        f"{sizes}, modes {[_mode_name(m) for m in modes]}: {n} timed launches "
        f"(+{args.warmup * len(doors) * len(sizes)} warm-up)"
    )
    t_start = time.perf_counter()
    launches, runs = _run_all(args, doors, modes, sizes)
    info = next(
        {k: rec["ranks"][0][k] for k in ("params", "tensors", "model_bytes")}
        for rec in launches
        if rec["door"] != "limit"
    )
    groups = []
    for (settle, ws), per_run in runs.items():
        groups.append(
            {
                "mode": _mode_name(settle),
                "settle_s": settle,
                "world_size": ws,
                "threads": _threads(ws),
                "omp_num_threads": str(_threads(ws)),
                "must_write_bytes": must_write_bytes(info["model_bytes"], info["params"], ws),
                "runs": per_run,
                "spread": summarize_runs(per_run),
                "loss_max_abs_diff": _loss_diff(per_run),
            }
        )
    header = (
        f"model {args.model}: {info['params'] / 1e9:.3f}B params in {info['tensors']} tensors, "
        f"{info['model_bytes'] / 2**30:.2f} GiB bf16; ZeRO-{args.stage}; {_cores()} cores, "
        f"OMP_NUM_THREADS = cores // ranks; first step on 1 x {args.seq} tokens; "
        f"{args.runs} run(s) x {args.trials} trial(s) per "
        f"door; {time.perf_counter() - t_start:.0f} s in all"
    )
    machine = _machine(load_before)
    header += (
        f"\n{machine['node']}: {machine['cpu']}, torch {machine['torch']}, deepspeed "
        f"{machine.get('deepspeed', '-')}; 1-min load average {load_before[0]:.1f} before, "
        f"{machine['load_average_after'][0]:.1f} after"
    )
    if max(load_before[0], machine["load_average_after"][0]) > _cores():
        header += f" (above {_cores()}: other work shared the cores, the figures are disturbed)"
    print(header)
    for door, why in skipped.items():
        print(f"skipped {door}: {why}")
    print(_table(groups, doors))
    result = {
        "benchmark": "doors",
        "command": command_line(args),
        "date": utc_timestamp(),
        "machine": machine,
        "spec": {
            "model": args.model,
            "world_sizes": sizes,
            "settle_s": modes,
            "runs": args.runs,
            "trials": args.trials,
            "warmup": args.warmup,
            "doors": list(doors),
            "stage": args.stage,
            "bucket_numel": args.bucket_numel,
            "seq": args.seq,
            "seed": args.seed,
            "limit_repeats": args.limit_repeats,
            "config": config,
            "omp_num_threads": {str(ws): _threads(ws) for ws in sizes},
        },
        "model": {"name": args.model, **info},
        "groups": groups,
        "launches": launches,
        "skipped": skipped,
        "seconds": time.perf_counter() - t_start,
    }
    if args.plot:
        plotted = _plot(args.plot, groups, doors, f"flatzero bench doors: {args.model}")
        result["plot"] = args.plot if plotted else None
        print(f"plot: {args.plot}" if plotted else "plot: skipped (matplotlib is not installed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0
