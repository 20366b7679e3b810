"""Offload benchmark: ZeRO-Offload (``offload_optimizer: {device: cpu}``), flatzero vs DeepSpeed.

``--what`` picks the parts (comma-separated; default all four), each printing its table:

- ``kernel``: the host optimizer step over one flat fp32 tensor of ``--numel`` elements,
  flatzero's (``torch.optim.AdamW(fused=True)`` on the CPU) against DeepSpeed's
  ``DeepSpeedCPUAdam`` (AVX, OpenMP), torch's foreach and single-tensor AdamW for context,
  alternating step by step in one process per thread count (``--kernel-threads``: each
  rank's share of the cores at each world size by default), ``OMP_NUM_THREADS`` and
  ``torch.set_num_threads`` set alike; see ``offload_kernel``. Before that, DeepSpeed's
  ``cpu_adam`` op is JIT-built into an empty ``TORCH_EXTENSIONS_DIR`` in a process of its
  own, timed, as on a fresh machine (``--no-build``: skipped, the default extensions
  directory is used); flatzero builds nothing.
- ``step``: whole training steps with offload on the host (gloo, DeepSpeed's CPU
  accelerator): ``flatzero.initialize`` against ``deepspeed.initialize`` with the same
  config, alternating step by step in one launch per world size; see ``offload_step``.
- ``init``: ``flatzero.initialize`` against ``deepspeed.initialize`` with the same offload
  config (``offload_trial.offload_config``), each launch its own ``torchrun`` job (a fresh
  process per rank), the doors alternating, ``--settle-s`` seconds before every launch;
  each launch also takes ``--init-steps`` steps and records host memory; see
  ``offload_trial``.
- ``memory``: the host bytes of offload per rank as ``flatzero plan`` states them
  (``plan.memory_model.offload_host_memory``: fp32 master + optimizer state + fp32
  gradient shard) beside what flatzero's optimizer allocated (``offload_host_bytes()``)
  and the RSS a flatzero launch gained from before ``initialize`` to after its steps
  (the ``init`` part's flatzero launches, or one launch per world size of its own).

Every part ends in the result; the last line on stdout is the whole result as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from flatzero.testing.deepspeed import without_unavailable_deepspeed
from flatzero_bench.common.machine import describe_host
from flatzero_bench.common.paths import with_import_paths
from flatzero_bench.common.ranks import threads_per_rank
from flatzero_bench.common.results import emit, print_skipped, result_head
from flatzero_bench.common.settings import parse_list
from flatzero_bench.offload import offload_step
from flatzero_bench.offload.offload_kernel import HYPERPARAMETERS, KERNEL_METHODS
from flatzero_bench.offload.offload_kernel import MARKER as KERNEL_MARKER
from flatzero_bench.offload.offload_trial import DOORS, PHASES, offload_config
from flatzero_bench.offload.offload_trial import MARKER as TRIAL_MARKER
from flatzero_bench.offload.options import PARTS, STEP_METHODS

__all__ = ["PARTS", "run"]


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _child_env(threads: int | None = None, extensions_dir: str | None = None) -> dict[str, str]:
    """The environment of a child process: this flatzero importable, DeepSpeed on the CPU,
    and ``threads`` OpenMP threads where given."""
    env = dict(os.environ)
    with_import_paths(env)
    env.setdefault("DS_ACCELERATOR", "cpu")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    if extensions_dir is not None:
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir
    return env


def _child(
    module: str, argv: list[str], env: dict[str, str], marker: str, timeout_s: float
) -> dict[str, Any]:
    """Run ``python -m module argv`` and parse its ``marker`` line (with its wall seconds)."""
    cmd = [sys.executable, "-m", module, *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]
    if not lines:
        err = proc.stderr.splitlines()
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode} without a result line:\n"
            + "\n".join(proc.stdout.splitlines()[-10:] + err[-40:])
        )
    return json.loads(lines[-1][len(marker) :]) | {"process_s": wall}


# --- kernel ---------------------------------------------------------------------------


def _build(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str | None]:
    """DeepSpeed's ``cpu_adam`` JIT build into an empty directory, timed; the directory
    the kernel launches then use (None: the default)."""
    if args.extensions_dir:
        return None, args.extensions_dir
    if args.no_build:
        return None, None
    target = tempfile.mkdtemp(prefix="flatzero-ds-ext-", dir=args.workdir)
    _progress(f"kernel: building DeepSpeed's cpu_adam into the empty {target} ...")
    rec = _child(
        "flatzero_bench.offload.offload_kernel",
        ["--build-only"],
        _child_env(extensions_dir=target),
        KERNEL_MARKER,
        args.timeout_s,
    )
    _progress(
        f"kernel: cpu_adam JIT build {rec['build_s']:.1f} s, {rec['build_cpu_s']:.1f} CPU s "
        f"(process {rec['process_s']:.1f} s)"
    )
    return rec, target


def _kernel_rows(launches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per thread count and method: the median over every launch's timed steps, the ratio
    to DeepSpeed's, and the largest difference from flatzero's result."""
    rows = []
    for threads in dict.fromkeys(rec["threads"] for rec in launches):
        mine = [rec for rec in launches if rec["threads"] == threads]
        methods = [r["method"] for r in mine[0]["rows"]]
        medians = {}
        for method in methods:
            steps = [s for rec in mine for r in rec["rows"] if r["method"] == method
                     for s in r["step_s"]]  # fmt: skip
            per_run = [r["step_s_median"] for rec in mine for r in rec["rows"]
                       if r["method"] == method]  # fmt: skip
            of = [r for rec in mine for r in rec["rows"] if r["method"] == method]
            medians[method] = statistics.median(steps)
            rows.append(
                {
                    "threads": threads,
                    "method": method,
                    "step_s_median": medians[method],
                    "step_s_min": min(steps),
                    "run_medians_s": per_run,
                    "steps": len(steps),
                    "cpu_over_wall": statistics.median(r["cpu_over_wall"] for r in of),
                    "optimizer": of[0].get("optimizer"),
                    "fused": of[0].get("fused"),
                    "param_max_abs_diff": max(r["param_max_abs_diff"] for r in of),
                    "exp_avg_sq_max_abs_diff": max(r["exp_avg_sq_max_abs_diff"] for r in of),
                }
            )
        for row in rows[-len(methods) :]:
            base = medians.get("deepspeed")
            row["x_deepspeed"] = row["step_s_median"] / base if base else None
            row["x_flatzero"] = row["step_s_median"] / medians["flatzero"]
    return rows


def _kernel_table(rows: list[dict[str, Any]], numel: int) -> str:
    head = (
        f"{'threads':>7} {'method':<20} {'ms/step':>8} {'min ms':>7} {'GB/s':>6} "
        f"{'x deepspeed':>11} {'CPU/wall':>8} {'max |dp|':>9} {'max |dv|':>9}"
    )
    lines = [head, "-" * len(head)]
    # AdamW reads param, grad, exp_avg, exp_avg_sq and writes three of them: 28 bytes/element.
    traffic = 28 * numel
    for r in rows:
        x = "-" if r["x_deepspeed"] is None else f"{r['x_deepspeed']:.3f}x"
        lines.append(
            f"{r['threads']:>7} {r['method']:<20} {r['step_s_median'] * 1e3:>8.1f} "
            f"{r['step_s_min'] * 1e3:>7.1f} {traffic / r['step_s_median'] / 1e9:>6.1f} {x:>11} "
            f"{r['cpu_over_wall']:>8.2f} {r['param_max_abs_diff']:>9.2e} "
            f"{r['exp_avg_sq_max_abs_diff']:>9.2e}"
        )
    lines.append(
        "max |dp|, max |dv|: the largest difference of the params and of the second moment "
        "from flatzero's after every step (same init, same gradients, same AdamW settings)"
    )
    return "\n".join(lines)


def _kernel(args: argparse.Namespace, has_deepspeed: bool) -> dict[str, Any]:
    """The ``kernel`` part: the JIT build, then ``--runs`` launches per thread count."""
    methods = [m for m in args.kernel_methods if has_deepspeed or not m.startswith("deepspeed")]
    uses_deepspeed = any(m.startswith("deepspeed") for m in methods)
    build, ext_dir = _build(args) if uses_deepspeed else (None, None)
    threads = args.kernel_threads or sorted(
        {threads_per_rank(ws) for ws in args.world_sizes}, reverse=True
    )
    launches = []
    for run in range(args.runs):
        for n in threads:
            argv = ["--threads", str(n), "--numel", str(args.numel), "--steps",
                    str(args.kernel_steps), "--warmup", str(args.kernel_warmup),
                    "--seed", str(run), "--methods", ",".join(methods)]  # fmt: skip
            env = _child_env(threads=n, extensions_dir=ext_dir)
            rec = _child(
                "flatzero_bench.offload.offload_kernel", argv, env, KERNEL_MARKER, args.timeout_s
            )
            rec["run"] = run
            launches.append(rec)
            medians = ", ".join(
                f"{r['method']} {r['step_s_median'] * 1e3:.1f}" for r in rec["rows"]
            )
            _progress(f"kernel run {run + 1}/{args.runs}, {n} thread(s): ms/step {medians}")
    rows = _kernel_rows(launches)
    return {
        "numel": args.numel,
        "methods": methods,
        "hyperparameters": HYPERPARAMETERS | {"bias_correction": True, "adamw_mode": True},
        "threads": threads,
        "jit_build": build,
        "extensions_dir": ext_dir,
        "rows": rows,
        "launches": launches,
    }


# --- step ---------------------------------------------------------------------------


def _step(args: argparse.Namespace, has_deepspeed: bool, ext_dir: str | None) -> dict[str, Any]:
    """The ``step`` part: one launch of ranks per world size (and run)."""
    from flatzero.launch import run_ranks
    from flatzero_bench.offload import offload_step

    methods = tuple(m for m in args.step_methods if has_deepspeed or "deepspeed" not in m)
    spec = offload_step.OffloadStepSpec(
        model=args.step_model,
        dtype=args.step_dtype,
        methods=methods,
        stage=args.stage,
        batch=args.step_batch,
        seq=args.step_seq,
        warmup=args.step_warmup,
        steps=args.step_steps,
        bucket_numel=args.bucket_numel,
        communication_data_type=args.communication_data_type,
    )
    env = {"DS_ACCELERATOR": "cpu"}
    if ext_dir:
        env["TORCH_EXTENSIONS_DIR"] = ext_dir
    rows: list[dict[str, Any]] = []
    for run in range(args.runs):
        for ws in args.world_sizes:
            env["OMP_NUM_THREADS"] = str(threads_per_rank(ws))
            ranks = run_ranks(offload_step.rank_main, ws, spec, env=env, timeout_s=args.timeout_s)
            done = [r | {"run": run} for r in offload_step.summarize(ws, ranks, spec)]
            rows.extend(done)
            _progress(f"step run {run + 1}/{args.runs}, {ws} rank(s):\n" + offload_step.table(done))
    return {
        "spec": dataclasses.asdict(spec),
        "config": offload_config(stage=args.stage, bucket_numel=args.bucket_numel),
        "rows": rows,
        "summary": _step_summary(rows),
    }


def _step_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world size and method, over runs: the median of each run's median total and
    step, and of their ratios to the baseline (min / median / max over runs)."""
    out = []
    for ws in dict.fromkeys(r["world_size"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows if r["world_size"] == ws):
            mine = [r for r in rows if r["world_size"] == ws and r["method"] == method]
            entry: dict[str, Any] = {"world_size": ws, "method": method}
            for key in ("fwd_s", "bwd_s", "step_s", "total_s"):
                entry[key] = statistics.median(r[key] for r in mine)
            if mine[0]["x_baseline"]:
                for key in ("step", "total", "bwd_plus_step"):
                    xs = [r["x_baseline"][key] for r in mine]
                    entry[f"x_baseline_{key}"] = {
                        "min": min(xs), "median": statistics.median(xs), "max": max(xs)
                    }  # fmt: skip
            out.append(entry)
    return out


# --- init and memory ------------------------------------------------------------------


def _launch_trial(
    door: str, ws: int, args: argparse.Namespace, ext_dir: str | None
) -> dict[str, Any]:
    """One ``torchrun`` job of ``offload_trial``; its result line."""
    argv = [
        "torch.distributed.run", "--standalone", "--nproc-per-node", str(ws),
        "-m", "flatzero_bench.offload.offload_trial", "--door", door, "--model", args.init_model,
        "--stage", str(args.stage), "--bucket-numel", str(args.bucket_numel),
        "--seq", str(args.init_seq), "--steps", str(args.init_steps),
    ]  # fmt: skip
    env = _child_env(threads=threads_per_rank(ws), extensions_dir=ext_dir)
    return _child(argv[0], argv[1:], env, TRIAL_MARKER, args.timeout_s)


def _slowest(rec: dict[str, Any]) -> dict[str, Any]:
    """A launch's init and step seconds on its slowest rank, and each rank's memory."""
    ranks = rec["ranks"]
    return {
        "init_s": max(r["init_s"] for r in ranks),
        "init_cpu_s": max(r["init_cpu_s"] for r in ranks),
        "first_step_s": max(r["step_s"][0] for r in ranks),
        "later_step_s": max(statistics.median(r["step_s"][1:]) for r in ranks)
        if len(ranks[0]["step_s"]) > 1
        else None,
        "rss_gain_bytes": max(r["rss_step_bytes"][-1] - r["rss_before_bytes"] for r in ranks),
        "peak_gain_bytes": max(r["peak_rss_bytes"] - r["rss_before_bytes"] for r in ranks),
        "optimizer": ranks[0]["optimizer"],
        "inner_optimizer": ranks[0]["inner_optimizer"],
        "loss": ranks[0]["loss"],
    }


def _init(args: argparse.Namespace, doors: tuple[str, ...], ext_dir: str | None) -> dict:
    """The ``init`` part: ``--init-warmup`` untimed launches of each door per world size,
    then ``--runs`` x ``--init-trials`` launches of each, alternating (order rotating),
    ``--settle-s`` seconds before each."""
    from flatzero_bench.common.trials import rotated

    for ws in args.world_sizes:
        for _ in range(args.init_warmup):
            for door in doors:
                time.sleep(args.settle_s)
                rec = _launch_trial(door, ws, args, ext_dir)
                _progress(f"init warm-up, {ws} rank(s), {door}: "
                          f"{_slowest(rec)['init_s']:.2f} s (untimed)")  # fmt: skip
    launches = []
    for run in range(args.runs):
        for ws in args.world_sizes:
            for trial in range(args.init_trials):
                for door in rotated(doors, run + trial):
                    time.sleep(args.settle_s)
                    rec = _launch_trial(door, ws, args, ext_dir)
                    rec |= {"run": run, "trial": trial, "slowest": _slowest(rec)}
                    launches.append(rec)
                    fig = rec["slowest"]
                    _progress(
                        f"init run {run + 1}/{args.runs}, {ws} rank(s), {door}: init "
                        f"{fig['init_s']:.2f} s, first step {fig['first_step_s']:.2f} s, "
                        f"RSS +{fig['rss_gain_bytes'] / 2**30:.2f} GiB per rank"
                    )
    return {
        "model": args.init_model,
        "settle_s": args.settle_s,
        "config": offload_config(stage=args.stage, bucket_numel=args.bucket_numel),
        "launches": launches,
        "rows": _init_rows(launches, doors),
    }


def _init_rows(launches: list[dict[str, Any]], doors: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per world size and door: medians over launches; flatzero / DeepSpeed per pair of
    neighbouring launches (the same run and trial) and its spread."""
    rows = []
    for ws in dict.fromkeys(rec["world_size"] for rec in launches):
        here = [rec for rec in launches if rec["world_size"] == ws]
        for door in doors:
            mine = [rec["slowest"] for rec in here if rec["door"] == door]
            rows.append(
                {
                    "world_size": ws,
                    "door": door,
                    "launches": len(mine),
                    "init_s": statistics.median(m["init_s"] for m in mine),
                    "init_s_all": [m["init_s"] for m in mine],
                    "init_cpu_s": statistics.median(m["init_cpu_s"] for m in mine),
                    "first_step_s": statistics.median(m["first_step_s"] for m in mine),
                    "rss_gain_bytes": statistics.median(m["rss_gain_bytes"] for m in mine),
                    "peak_gain_bytes": statistics.median(m["peak_gain_bytes"] for m in mine),
                    "optimizer": mine[0]["optimizer"],
                    "inner_optimizer": mine[0]["inner_optimizer"],
                }
            )
        if set(doors) == set(DOORS):
            pairs = {}
            for rec in here:
                pairs.setdefault((rec["run"], rec["trial"]), {})[rec["door"]] = rec["slowest"]
            ratios = [p["flatzero"]["init_s"] / p["deepspeed"]["init_s"] for p in pairs.values()]
            row = rows[-len(doors)]
            row["x_deepspeed_init"] = {
                "min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
                "pairs": ratios,
            }  # fmt: skip
    return rows


def _init_table(part: dict[str, Any]) -> str:
    head = (
        f"{'ranks':>5} {'door':<10} {'optimizer (inner)':<30} {'init s':>7} {'CPU s':>6} "
        f"{'1st step s':>10} {'RSS +GiB':>8} {'flatzero / deepspeed init':>28}"
    )
    lines = [head, "-" * len(head)]
    for r in part["rows"]:
        x = r.get("x_deepspeed_init")
        ratio = f"{x['min']:.2f} / {x['median']:.2f} / {x['max']:.2f}" if x else ""
        opt = f"{r['optimizer']} ({r['inner_optimizer']})"
        lines.append(
            f"{r['world_size']:>5} {r['door']:<10} {opt:<30} {r['init_s']:>7.2f} "
            f"{r['init_cpu_s']:>6.2f} {r['first_step_s']:>10.2f} "
            f"{r['rss_gain_bytes'] / 2**30:>8.2f} {ratio:>28}"
        )
    lines.append(
        "per launch the slowest rank; medians over launches; the ratio: min / median / max "
        f"over pairs of neighbouring launches; {part['settle_s']:g} s pause before each launch"
    )
    return "\n".join(lines)


def _memory(
    args: argparse.Namespace, init: dict[str, Any] | None, ext_dir: str | None
) -> dict[str, Any]:
    """The ``memory`` part: per world size, the plan's formula against the bytes flatzero's
    optimizer allocated and the RSS its launches gained (median over launches).

    Each row's ratios: ``*_over_formula`` to the offload host bytes alone;
    ``*_over_formula_plus_other`` to those plus ``other_bytes`` (the reducer's staging
    slots and the buckets' padding, which the plan counts with the device's model states:
    host memory here); ``backward_peak_over_plan`` to everything ``flatzero plan`` states
    the rank holds in backward, i.e. also ``largest_gradient_bytes`` (autograd's largest
    gradient, ``memory_model.largest_gradient_bytes``). ``held_gradient_peak_bytes``: the
    reducer's own record of the most gradient bytes it held at once
    (``ZeroOptimizer.held_gradient_peak_bytes``)."""
    from flatzero.plan.memory_model import offload_host_memory
    from flatzero.plan.model_source import resolve_model
    from flatzero.plan.planner import PlanSpec, make_plan

    launches = [rec for rec in (init or {}).get("launches", []) if rec["door"] == "flatzero"]
    rows = []
    for ws in args.world_sizes:
        mine = [rec for rec in launches if rec["world_size"] == ws]
        if not mine:
            time.sleep(args.settle_s)
            mine = [_launch_trial("flatzero", ws, args, ext_dir)]
        plan = make_plan(
            PlanSpec(
                model=resolve_model(args.init_model),
                gpus_per_node=ws,
                gpu=None,
                stage=args.stage,
                bucket_numel=args.bucket_numel,
                offload_optimizer=True,
            )
        )
        formula = offload_host_memory(plan.layout, optimizer="adamw", pinned=False)
        # Besides offload's bytes a rank gains its reduction staging slots and the
        # buckets' padding (the buckets replace the params' own storage).
        other = plan.states.grad_staging + plan.states.params - mine[0]["ranks"][0]["model_bytes"]
        ranks = [r for rec in mine for r in rec["ranks"]]
        gains = [r["rss_step_bytes"][-1] - r["rss_before_bytes"] for r in ranks]
        peaks = [r["peak_rss_bytes"] - r["rss_before_bytes"] for r in ranks]
        phase_peaks = (  # launch records from before the phases were recorded lack them
            {
                phase: statistics.median(
                    max(r["peak_rss_phase_bytes"][phase]) - r["rss_before_bytes"] for r in ranks
                )
                for phase in PHASES
            }
            if all("peak_rss_phase_bytes" in r for r in ranks)
            else None
        )
        allocated = [r["offload_host_bytes"] for r in ranks]
        held = statistics.median(r.get("held_gradient_peak_bytes", 0) for r in ranks)
        gain = statistics.median(gains)
        expected = formula.total + other
        rows.append(
            {
                "world_size": ws,
                "formula": dataclasses.asdict(formula) | {"total": formula.total},
                "allocated": allocated[0]
                | {"total": sum(v for k, v in allocated[0].items() if k != "pinned")},
                "allocated_equal_on_every_rank": all(a == allocated[0] for a in allocated),
                "other_bytes": other,
                "rss_gain_bytes": gain,
                "rss_gain_bytes_all": gains,
                "peak_gain_bytes": statistics.median(peaks),
                "rss_over_formula": gain / formula.total,
                "rss_over_formula_plus_other": gain / expected,
                "peak_over_formula": statistics.median(peaks) / formula.total,
                "phase_peak_gain_bytes": phase_peaks,
                **{
                    f"{phase}_peak_over_formula": phase_peaks[phase] / formula.total
                    if phase_peaks
                    else None
                    for phase in ("step", "backward")
                },
                **{
                    f"{phase}_peak_over_formula_plus_other": phase_peaks[phase] / expected
                    if phase_peaks
                    else None
                    for phase in ("step", "backward")
                },
                "held_gradient_peak_bytes": held,
                "largest_gradient_bytes": plan.largest_gradient,
                "backward_peak_over_plan": (
                    phase_peaks["backward"] / (expected + plan.largest_gradient)
                    if phase_peaks
                    else None
                ),
                "launches": len(mine),
            }
        )
    return {"model": args.init_model, "rows": rows}


def _memory_table(part: dict[str, Any]) -> str:
    gib = 2**30
    head = (
        f"{'ranks':>5} {'plan: master + state + grads = total GiB':>42} {'+ other':>7} "
        f"{'allocated':>9} {'RSS +GiB':>8} {'/ exp':>6} {'step peak +':>11} {'/ exp':>6} "
        f"{'backward peak +':>15} {'/ exp':>6} {'held':>5} {'+ largest grad':>14} "
        f"{'/ exp + lg':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in part["rows"]:
        f = r["formula"]
        plan = (
            f"{f['master'] / gib:.2f} + {f['state'] / gib:.2f} + {f['grads'] / gib:.2f} = "
            f"{f['total'] / gib:.2f}"
        )
        phase = r.get("phase_peak_gain_bytes")
        peaks = (
            f"{phase['step'] / gib:>11.2f} {r['step_peak_over_formula_plus_other']:>6.3f} "
            f"{phase['backward'] / gib:>15.2f} {r['backward_peak_over_formula_plus_other']:>6.3f} "
            f"{r['held_gradient_peak_bytes'] / gib:>5.2f} "
            f"{r['largest_gradient_bytes'] / gib:>14.2f} {r['backward_peak_over_plan']:>10.3f}"
            if phase
            else f"{r['peak_gain_bytes'] / gib:>11.2f} (whole span: no phases recorded)"
        )
        lines.append(
            f"{r['world_size']:>5} {plan:>42} {r['other_bytes'] / gib:>7.2f} "
            f"{r['allocated']['total'] / gib:>9.2f} {r['rss_gain_bytes'] / gib:>8.2f} "
            f"{r['rss_over_formula_plus_other']:>6.3f} {peaks}"
        )
    lines.append(
        "GiB per rank. plan: flatzero plan's offload host bytes; + other: the reducer's "
        "staging slots and the buckets' padding (device memory, here host memory too); "
        "exp: plan + other. RSS +: a rank's resident set after its steps (gc + malloc_trim) "
        "minus before flatzero.initialize (the model built); step / backward peak +: the "
        "high-water mark of the steps' optimizer step (offload's host memory all live) / "
        "backward phases (with the memory of the model's own compute, host memory on a "
        "machine without an accelerator) minus the same; held: the most bytes of "
        "autograd's gradients the reducer held at once (ZeroOptimizer."
        "held_gradient_peak_bytes); + largest grad: what flatzero plan adds in backward, "
        "autograd's largest gradient (made whole before the reducer copies it out); "
        "median over launches and ranks"
    )
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------


def _checked(args: argparse.Namespace) -> tuple[str, ...]:
    parts = tuple(p for p in args.what.split(",") if p)
    if not parts or set(parts) - set(PARTS):
        raise SystemExit(f"--what {args.what!r}: choose from {', '.join(PARTS)}")
    args.world_sizes = parse_list(args.world_sizes, int, "--world-sizes")
    args.kernel_threads = (
        parse_list(args.kernel_threads, int, "--kernel-threads") if args.kernel_threads else None
    )
    args.kernel_methods = tuple(m for m in args.kernel_methods.split(",") if m)
    if set(args.kernel_methods) - set(KERNEL_METHODS) or "flatzero" not in args.kernel_methods:
        raise SystemExit(
            f"--kernel-methods {','.join(args.kernel_methods)!r}: flatzero and any of "
            + ", ".join(KERNEL_METHODS)
        )
    if args.kernel_methods[0] != "flatzero":  # the reference the others are compared with
        args.kernel_methods = ("flatzero", *(m for m in args.kernel_methods if m != "flatzero"))
    args.step_methods = tuple(m for m in args.step_methods.split(",") if m)
    if not args.step_methods or set(args.step_methods) - set(STEP_METHODS):
        raise SystemExit(f"--step-methods: choose from {', '.join(STEP_METHODS)}")
    from flatzero.models.bench_models import STEP_MODELS
    from flatzero_bench.init.init_bench import MODELS as INIT_MODELS

    if args.step_model not in STEP_MODELS or args.init_model not in INIT_MODELS:
        raise SystemExit(
            f"--step-model: one of {', '.join(STEP_MODELS)}; --init-model: one of "
            + ", ".join(INIT_MODELS)
        )
    for name in ("runs", "numel", "kernel_steps", "step_steps", "init_trials", "init_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    return parts


def run(args: argparse.Namespace) -> int:
    """Run the parts asked for; print their tables and one JSON line."""
    parts = _checked(args)
    _, skipped = without_unavailable_deepspeed(() if args.no_deepspeed else ("deepspeed",))
    has_deepspeed = not args.no_deepspeed and not skipped
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    result: dict[str, Any] = {**result_head("offload", args), "parts": list(parts)}
    tables = []
    ext_dir = args.extensions_dir
    if "kernel" in parts:
        kernel = _kernel(args, has_deepspeed)
        result["kernel"] = kernel
        ext_dir = kernel["extensions_dir"] or ext_dir
        build = kernel["jit_build"]
        built = (
            f"DeepSpeed cpu_adam JIT build on this machine (empty TORCH_EXTENSIONS_DIR): "
            f"{build['build_s']:.1f} s wall, {build['build_cpu_s']:.1f} s CPU (compilers); "
            "flatzero: none"
            if build
            else "DeepSpeed cpu_adam JIT build: not timed"
        )
        tables.append(
            f"kernel: AdamW step over {args.numel / 1e6:.0f}M fp32 elements, median of "
            f"{args.runs} run(s) x {args.kernel_steps} steps per method\n"
            + _kernel_table(kernel["rows"], args.numel)
            + f"\n{built}"
        )
    if "step" in parts:
        step = result["step"] = _step(args, has_deepspeed, ext_dir)
        tables.append(
            f"step: {args.step_model}, {args.step_dtype}, ZeRO-{args.stage}, "
            f"{args.step_batch} x {args.step_seq} tokens per rank, median of {args.runs} "
            f"run(s) x {args.step_steps} steps per method\n" + offload_step.table(step["rows"])
        )
    doors = DOORS if has_deepspeed else ("flatzero",)
    init = None
    if "init" in parts:
        init = result["init"] = _init(args, doors, ext_dir)
        tables.append(
            f"init with offload: {args.init_model}, bf16, ZeRO-{args.stage}\n" + _init_table(init)
        )
    if "memory" in parts:
        memory = result["memory"] = _memory(args, init, ext_dir)
        tables.append(
            f"host memory of offload per rank: {args.init_model}, bf16, ZeRO-{args.stage}, "
            "AdamW\n" + _memory_table(memory)
        )
    machine = describe_host(load_before)
    result["machine"] = machine
    result["seconds"] = time.perf_counter() - t0
    print(
        f"{machine['node']}: {machine['cpus']} cpus ({machine['cores_usable']} usable), "
        f"{machine['cpu']}, torch {machine['torch']}, deepspeed {machine.get('deepspeed', '-')}"
        f"; 1-min load average {load_before[0]:.1f} before, "
        f"{machine['load_average_after'][0]:.1f} after"
    )
    print_skipped(skipped)
    print("\n\n".join(tables))
    result["skipped"] = skipped
    emit(result, args.json)
    return 0
