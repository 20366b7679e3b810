"""Plan benchmark: ``flatzero plan``'s predicted CPU init time against a measured one.

One run, per world size: measure this machine's rates (``plan.calibration.measure``, what
``flatzero info --measure`` does) at the sizes of that world size's largest bucket and
master shard, with as many processes writing new memory at once as there are ranks; then
one launch of fresh rank processes
(``launch.run_ranks``) that build the model on the host and time, alternately and in
rotating order, ``flatten_parameters`` (tier ``cpu``, with the fp32 master) and the two
DeepSpeed algorithms of ``bench.baselines``. The prediction is ``make_plan`` of a CPU-only
job with the measured rates; a figure is the slowest rank's time. The result is the median
over rounds of predicted / measured; the target is flatzero within 25%. The DeepSpeed rows
show how far the same model carries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from flatzero.config import FlattenConfig
from flatzero.cores import usable_cores
from flatzero.dtypes import dtype_name
from flatzero.flatten import flatten_parameters
from flatzero.launch import run_ranks
from flatzero.measure.baselines import flatten_legacy_cpu, flatten_torch_cat
from flatzero.models import build_model
from flatzero.plan.calibration import Calibration, measure
from flatzero.plan.hardware import get_host
from flatzero.plan.model_source import resolve_model
from flatzero.plan.planner import Plan, PlanSpec, make_plan, new_memory_sizes
from flatzero.procmem import trim_host_memory
from flatzero_bench.common.provenance import command_line, utc_timestamp
from flatzero_bench.common.settings import BENCH_DTYPES
from flatzero_bench.plan.options import METHODS

__all__ = ["predict", "run"]

TARGET = 0.25
"""flatzero's predicted time must be within this fraction of its measured time."""


@dataclass(frozen=True)
class PlanBenchSpec:
    """One run's settings (identical on every rank).

    Attributes:
        model: a preset or benchmark model.
        dtype: ``bf16`` or ``fp32``.
        bucket_numel: ``FlattenConfig.bucket_numel``.
        trials: timed rounds (each: every method once).
        warmup: untimed rounds first.
        settle_s: seconds slept before each trial and each calibration pass (10: cold).
        methods: keys of ``METHODS``.
    """

    model: str
    dtype: str
    bucket_numel: int
    trials: int
    warmup: int
    settle_s: float
    methods: tuple[str, ...]


def _plan(spec: PlanBenchSpec, world_size: int, calibration: Calibration | None) -> Plan:
    """A CPU-only plan of one node with ``world_size`` ranks."""
    return make_plan(
        PlanSpec(
            model=resolve_model(spec.model),
            nodes=1,
            gpus_per_node=world_size,
            gpu=None,
            host=get_host("dgx-h100"),  # every figure the CPU tier uses is replaced
            dtype=dtype_name(BENCH_DTYPES[spec.dtype]),
            bucket_numel=spec.bucket_numel,
            params_on="host",
            calibration=calibration,
        )
    )


def predict(
    spec: PlanBenchSpec, world_size: int, calibration: Calibration
) -> dict[str, dict[str, Any]]:
    """Predicted seconds (and phases) of each method at ``world_size`` ranks on this
    machine, from ``calibration``."""
    plan = _plan(spec, world_size, calibration)
    return {
        method: {
            "seconds": plan.methods[name].time.seconds,
            "phases": plan.methods[name].time.phases,
        }
        for method, name in METHODS.items()
        if method in spec.methods
    }


def _time_one(
    method: str, model: torch.nn.Module, spec: PlanBenchSpec, rank: int, ws: int
) -> tuple[float, dict[str, float]]:
    """Seconds of one init, and its phases (flatzero's init report; the baselines' own)."""
    dist.barrier()
    t0 = time.perf_counter()
    if method == "flatzero":
        config = FlattenConfig(
            tier="cpu", device="cpu", bucket_numel=spec.bucket_numel, progress=False
        )
        flat = flatten_parameters(model, config=config)
        seconds = time.perf_counter() - t0
        phases = {k: v for k, v in flat.report.phase_seconds.items() if v}
    else:
        groups = [[p for p in model.parameters() if p.requires_grad]]
        algorithm = flatten_torch_cat if method == "torch_cat" else flatten_legacy_cpu
        result = algorithm(groups, rank=rank, world_size=ws, device="cpu")
        seconds = time.perf_counter() - t0
        phases = {"flatten": result.flatten_s, "master": result.master_s}
    return seconds, phases


def _rank_main(rank: int, ws: int, spec: PlanBenchSpec) -> list[dict[str, Any]]:
    """Every timed round of this rank: each method's (seconds, phases)."""
    config = resolve_model(spec.model).config
    dtype = BENCH_DTYPES[spec.dtype]
    rounds = []
    for trial in range(spec.warmup + spec.trials):
        times = {}
        shift = trial % len(spec.methods)
        for method in spec.methods[shift:] + spec.methods[:shift]:
            model = build_model(config, device="cpu", dtype=dtype, seed=trial)
            trim_host_memory()
            time.sleep(spec.settle_s)
            times[method] = _time_one(method, model, spec, rank, ws)
            del model
            trim_host_memory()
        if trial >= spec.warmup:
            rounds.append(times)
    return rounds


def _rows(
    ws: int, ranks: list[list[dict[str, Any]]], spec: PlanBenchSpec, calibration: Calibration
) -> list[dict[str, Any]]:
    """One row per method: the prediction, the median over rounds of the measured time
    (the slowest rank's) and of predicted / measured."""
    guess = predict(spec, ws, calibration)
    rows = []
    for method in spec.methods:
        slowest = [
            max((r[i][method] for r in ranks), key=lambda t: t[0]) for i in range(len(ranks[0]))
        ]
        predicted = guess[method]["seconds"]
        ratios = [predicted / seconds for seconds, _ in slowest]
        rows.append(
            {
                "world_size": ws,
                "method": method,
                "predicted_s": predicted,
                "predicted_phases": guess[method]["phases"],
                "measured_s": statistics.median(seconds for seconds, _ in slowest),
                "predicted_over_measured": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "rounds": [
                    {"measured_s": seconds, "measured_phases": phases}
                    for seconds, phases in slowest
                ],
            }
        )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'ranks':>5} {'method':<11} {'predicted s':>11} {'measured s':>10} "
        f"{'pred/meas':>9} {'range over rounds':>17}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lo, hi = r["ratio_range"]
        lines.append(
            f"{r['world_size']:>5} {r['method']:<11} {r['predicted_s']:>11.3f} "
            f"{r['measured_s']:>10.3f} {r['predicted_over_measured']:>9.2f} "
            f"{f'{lo:.2f}-{hi:.2f}':>17}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Calibrate, predict, measure; print a table and one JSON line."""
    methods = tuple(m for m in args.methods.split(",") if m)
    if set(methods) - set(METHODS):
        raise SystemExit(f"unknown method(s); choose from {', '.join(METHODS)}")
    spec = PlanBenchSpec(
        args.model, args.dtype, args.bucket_numel, args.trials, args.warmup, args.settle_s, methods
    )
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    given = None
    if args.calibration:
        with open(args.calibration) as f:
            given = Calibration.from_dict(json.load(f))
    rows, calibrations = [], {}
    load_before = os.getloadavg()
    for ws in world_sizes:
        calibration = given or measure(
            ranks=min(ws, usable_cores()),
            settle_s=args.settle_s,
            **new_memory_sizes(_plan(spec, ws, None)),
        )
        calibrations[str(ws)] = calibration.to_dict()
        ranks = run_ranks(_rank_main, ws, spec, timeout_s=1800)
        rows.extend(_rows(ws, ranks, spec, calibration))
    print(
        f"model {spec.model} ({spec.dtype}) on {platform.node()}, {usable_cores()} cores, "
        f"1-minute load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(_table(rows))
    flatzero = [r for r in rows if r["method"] == "flatzero"]
    within = all(abs(r["predicted_over_measured"] - 1) <= TARGET for r in flatzero)
    print(f"flatzero within {TARGET:.0%} at every world size: {within}")
    result = {
        "benchmark": "plan",
        "command": command_line(args),
        "date": utc_timestamp(),
        "machine": {
            "host": platform.node(),
            "cpus": usable_cores(),
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "spec": asdict(spec),
        "calibrations": calibrations,
        "rows": rows,
        "target": TARGET,
        "flatzero_within_target": within,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    return 0
