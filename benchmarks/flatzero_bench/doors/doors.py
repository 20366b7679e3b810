"""Door against door: flatzero.initialize vs deepspeed.initialize, one torchrun launch each.

Every trial is its own ``torchrun`` job (``python -m torch.distributed.run --standalone
--nproc-per-node N -m flatzero_bench.doors.door_trial``), a fresh process per rank as at a
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
import subprocess
import sys
import time
from typing import Any

from flatzero.measure.limits import SETTLE_SECONDS
from flatzero.testing.deepspeed import without_unavailable_deepspeed
from flatzero_bench.common.machine import describe_host
from flatzero_bench.common.paths import with_import_paths
from flatzero_bench.common.ranks import threads_per_rank
from flatzero_bench.common.results import emit, print_skipped, result_head
from flatzero_bench.common.settings import parse_list
from flatzero_bench.common.trials import rotated
from flatzero_bench.doors.door_trial import DOORS, MARKER, door_config, must_write_bytes
from flatzero_bench.doors.doors_report import header, plot, table
from flatzero_bench.doors.doors_stats import loss_diff, slowest_rank, summarize_run, summarize_runs
from flatzero_bench.doors.options import add_arguments

__all__ = ["add_arguments", "compare_back_to_back", "run"]


def _launch(
    door: str, world_size: int, args: argparse.Namespace, *, limit_settle_s: float = 0.0
) -> dict[str, Any]:
    """One ``torchrun`` job of ``door_trial``; returns its parsed result line."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world_size),
        "-m", "flatzero_bench.doors.door_trial",
        "--door", door, "--model", args.model, "--stage", str(args.stage),
        "--bucket-numel", str(args.bucket_numel), "--seq", str(args.seq),
        "--seed", str(args.seed), "--limit-repeats", str(args.limit_repeats),
        "--limit-settle-s", str(limit_settle_s),
    ]  # fmt: skip
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads_per_rank(world_size))
    with_import_paths(env)  # so the job imports this flatzero and this harness
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


def _warm_up(args: argparse.Namespace, doors: tuple[str, ...], sizes: list[int]) -> None:
    """``--warmup`` untimed launches of each door per world size."""
    for ws in sizes:
        for i in range(args.warmup):
            for door in doors:
                rec = _launch(door, ws, args)
                _progress(f"warm-up {i + 1}/{args.warmup}, {ws} rank(s), {door}: "
                          f"init {slowest_rank(rec)['init_s']:.2f} s (untimed)")  # fmt: skip


def _limit(
    args: argparse.Namespace, run: int, settle: float, ws: int
) -> tuple[dict[str, Any], float]:
    """The launch that measures the first-touch limit: its record, and the slowest rank's
    seconds."""
    lim = _launch("limit", ws, args, limit_settle_s=SETTLE_SECONDS if settle > 0 else 0.0)
    limit_s = max(r["limit_s"] for r in lim["ranks"])
    lim |= {"run": run, "settle_s": settle}
    _progress(
        f"run {run + 1}/{args.runs} {_mode_name(settle)} {ws} rank(s) limit: "
        f"first touch of {lim['ranks'][0]['nbytes'] / 2**30:.2f} GiB per rank "
        f"{limit_s:.2f} s"
    )
    return lim, limit_s


def _one_run(
    args: argparse.Namespace,
    doors: tuple[str, ...],
    run: int,
    settle: float,
    ws: int,
    launches: list[dict[str, Any]],
) -> dict[str, Any]:
    """Run ``run`` of one mode and world size: ``--trials`` launches of each door, the order
    rotating, then the limit; every launch's record appended to ``launches``. Returns
    ``summarize_run``'s figures and the first-step loss of every trial and rank."""
    trials: dict[str, list[dict[str, float]]] = {d: [] for d in doors}
    losses: dict[str, list[float]] = {d: [] for d in doors}
    for trial in range(args.trials):
        for door in rotated(doors, run + trial):
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
    lim, limit_s = _limit(args, run, settle, ws)
    launches.append(lim)
    return summarize_run(trials, limit_s) | {"loss": losses}


def _run_all(
    args: argparse.Namespace, doors: tuple[str, ...], modes: list[float], sizes: list[int]
) -> tuple[list[dict[str, Any]], dict[tuple[float, int], list[dict[str, Any]]]]:
    """Every launch: warm-up, then runs x modes x world sizes x trials, then a limit."""
    _warm_up(args, doors, sizes)
    launches: list[dict[str, Any]] = []
    runs: dict[tuple[float, int], list[dict[str, Any]]] = {(m, w): [] for m in modes for w in sizes}
    for run in range(args.runs):
        for settle in modes:
            for ws in sizes:
                runs[(settle, ws)].append(_one_run(args, doors, run, settle, ws, launches))
    return launches, runs


def compare_back_to_back(
    model: str, world_size: int, *, trials: int = 1, warmup: int = 0
) -> tuple[dict[str, Any], dict[str, str]]:
    """One back-to-back run of the doors (``summarize_run``'s figures, the first-touch
    limit included), as ``flatzero demo`` shows it; and the doors skipped, with why."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", model, "--world-sizes", str(world_size), "--settle-s", "0",
         "--runs", "1", "--trials", str(trials), "--warmup", str(warmup)]
    )  # fmt: skip
    doors, skipped = without_unavailable_deepspeed(DOORS)
    _, runs = _run_all(args, doors, [0.0], [world_size])
    return runs[(0.0, world_size)][0], skipped


def _checked(args: argparse.Namespace) -> tuple[list[int], list[float], tuple[str, ...]]:
    """The world sizes, modes and doors asked for, checked."""
    sizes = parse_list(args.world_sizes, int, "--world-sizes")
    modes = parse_list(args.settle_s, float, "--settle-s")
    if any(w < 1 for w in sizes) or any(m < 0 for m in modes):
        raise SystemExit("--world-sizes must be >= 1 and --settle-s >= 0")
    for name in ("runs", "trials", "limit_repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    doors = tuple(d for d in args.doors.split(",") if d)
    if not doors or set(doors) - set(DOORS):
        raise SystemExit(f"--doors {args.doors!r}: choose from {', '.join(DOORS)}")
    return sizes, modes, doors


def _groups(
    runs: dict[tuple[float, int], list[dict[str, Any]]], info: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per mode and world size: its settings, its runs and their spread."""
    return [
        {
            "mode": _mode_name(settle),
            "settle_s": settle,
            "world_size": ws,
            "threads": threads_per_rank(ws),
            "omp_num_threads": str(threads_per_rank(ws)),
            "must_write_bytes": must_write_bytes(info["model_bytes"], info["params"], ws),
            "runs": per_run,
            "spread": summarize_runs(per_run),
            "loss_max_abs_diff": loss_diff(per_run),
        }
        for (settle, ws), per_run in runs.items()
    ]


def _spec(
    args: argparse.Namespace, sizes: list[int], modes: list[float], doors: tuple[str, ...]
) -> dict[str, Any]:
    """The settings of the run, as its result records them."""
    return {
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
        "config": door_config(stage=args.stage, bucket_numel=args.bucket_numel),
        "omp_num_threads": {str(ws): threads_per_rank(ws) for ws in sizes},
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print progress, a table and one JSON line."""
    sizes, modes, doors = _checked(args)
    doors, skipped = without_unavailable_deepspeed(doors)
    if not doors:
        raise SystemExit(f"no door left to time: {skipped['deepspeed']}")
    spec = _spec(args, sizes, modes, doors)
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
    groups = _groups(runs, info)
    seconds = time.perf_counter() - t_start
    machine = describe_host(load_before)
    print(header(args, info, machine, seconds))
    print_skipped(skipped)
    print(table(groups, doors))
    result = {
        **result_head("doors", args),
        "machine": machine,
        "spec": spec,
        "model": {"name": args.model, **info},
        "groups": groups,
        "launches": launches,
        "skipped": skipped,
        "seconds": time.perf_counter() - t_start,
    }
    if args.plot:
        plotted = plot(args.plot, groups, doors, f"flatzero bench doors: {args.model}")
        result["plot"] = args.plot if plotted else None
        print(f"plot: {args.plot}" if plotted else "plot: skipped (matplotlib is not installed)")
    emit(result, args.json)
    return 0
