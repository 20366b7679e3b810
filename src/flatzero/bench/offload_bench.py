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
- ``step``, ``init``, ``memory``: whole steps, init and host memory with offload (the
  offload path in flatzero's engine).

Every part ends in the result; the last line on stdout is the whole result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .deepspeed_runner import without_unavailable_deepspeed
from .machine import describe_host
from .offload_kernel import HYPERPARAMETERS, KERNEL_METHODS
from .offload_kernel import MARKER as KERNEL_MARKER
from .ranks import threads_per_rank
from .results import emit, print_skipped, result_head
from .settings import parse_list

__all__ = ["PARTS", "add_arguments", "run"]

PARTS = ("kernel", "step", "init", "memory")


def _progress(msg: str) -> None:
    print(msg, flush=True)


def _child_env(threads: int | None = None, extensions_dir: str | None = None) -> dict[str, str]:
    """The environment of a child process: this flatzero importable, DeepSpeed on the CPU,
    and ``threads`` OpenMP threads where given."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
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
    if args.no_build:
        return None, None
    target = tempfile.mkdtemp(prefix="flatzero-ds-ext-", dir=args.workdir)
    _progress(f"kernel: building DeepSpeed's cpu_adam into the empty {target} ...")
    rec = _child(
        "flatzero.bench.offload_kernel",
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
        f"{'threads':>7} {'method':<14} {'ms/step':>8} {'min ms':>7} {'GB/s':>6} "
        f"{'x deepspeed':>11} {'CPU/wall':>8} {'max |dp|':>9} {'max |dv|':>9}"
    )
    lines = [head, "-" * len(head)]
    # AdamW reads param, grad, exp_avg, exp_avg_sq and writes three of them: 28 bytes/element.
    traffic = 28 * numel
    for r in rows:
        x = "-" if r["x_deepspeed"] is None else f"{r['x_deepspeed']:.3f}x"
        lines.append(
            f"{r['threads']:>7} {r['method']:<14} {r['step_s_median'] * 1e3:>8.1f} "
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
    methods = [m for m in args.kernel_methods if has_deepspeed or m != "deepspeed"]
    build, ext_dir = _build(args) if "deepspeed" in methods else (None, None)
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
            rec = _child("flatzero.bench.offload_kernel", argv, env, KERNEL_MARKER, args.timeout_s)
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
        "rows": rows,
        "launches": launches,
    }


# --- the command ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench offload`` options."""
    parser.add_argument(
        "--what", default=",".join(PARTS), help=f"comma-separated of {', '.join(PARTS)}"
    )
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--runs", type=int, default=2, help="repeats of every part's launches")
    parser.add_argument("--numel", type=int, default=50_000_000, help="kernel: fp32 elements")
    parser.add_argument(
        "--kernel-threads",
        help="kernel: comma-separated thread counts (default: a rank's share of the cores at "
        "each world size)",
    )
    parser.add_argument("--kernel-steps", type=int, default=20, help="kernel: timed steps")
    parser.add_argument("--kernel-warmup", type=int, default=3, help="kernel: untimed steps")
    parser.add_argument(
        "--kernel-methods",
        default=",".join(KERNEL_METHODS),
        help=f"kernel: comma-separated of {', '.join(KERNEL_METHODS)}",
    )
    parser.add_argument(
        "--no-build",
        action="store_true",
        help="kernel: skip timing DeepSpeed's cpu_adam JIT build (use the default "
        "TORCH_EXTENSIONS_DIR)",
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed")
    parser.add_argument("--workdir", help="where temporary directories go (default: the system's)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per child process")
    parser.add_argument("--json", help="also write the result JSON to this path")


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
    for name in ("runs", "numel", "kernel_steps"):
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
    if "kernel" in parts:
        kernel = _kernel(args, has_deepspeed)
        result["kernel"] = kernel
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
