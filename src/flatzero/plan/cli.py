"""``flatzero plan`` and ``flatzero info --measure`` (their options: ``plan.options``)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
from pathlib import Path

from ..cores import usable_cores
from .calibration import Calibration, measure
from .hardware import GpuSpec, get_gpu, get_host
from .model_source import resolve_model
from .options import DTYPES, GPU_FIELDS
from .planner import PlanSpec, make_plan, new_memory_sizes
from .report import format_plan, plan_to_dict

__all__ = ["run", "run_measure", "spec_from_args"]


def _gpu(args: argparse.Namespace) -> GpuSpec | None:
    if args.gpu.lower() in ("none", "cpu"):
        return None
    gpu = get_gpu(args.gpu)
    changes = {
        field: int(value * scale) if field == "memory_bytes" else value
        for flag, (field, scale) in GPU_FIELDS.items()
        if (value := getattr(args, flag)) is not None
    }
    if changes:
        gpu = dataclasses.replace(gpu, source=gpu.source + "; overridden", **changes)
    return gpu


def _calibration(args: argparse.Namespace, spec: PlanSpec) -> Calibration | None:
    """The rates ``--calibrate`` measures (at the sizes of ``spec``'s writes into new
    memory) or ``--calibration`` reads; None for neither."""
    if args.calibrate:
        ranks = min(spec.gpus_per_node, usable_cores())
        return measure(ranks=ranks, settle_s=args.settle_s, **new_memory_sizes(make_plan(spec)))
    if args.calibration:
        return Calibration.from_dict(json.loads(Path(args.calibration).read_text()))
    return None


def spec_from_args(args: argparse.Namespace) -> PlanSpec:
    """The ``PlanSpec`` of parsed ``flatzero plan`` arguments."""
    model = resolve_model(
        args.model,
        layers=args.layers,
        expert_layout=args.expert_layout,
        with_lm_head=False if args.no_lm_head else None,
    )
    host = get_host(args.host)
    if args.host_bandwidth is not None:
        host = dataclasses.replace(host, memcpy_gbps=args.host_bandwidth, source="--host-bandwidth")
    gpu = _gpu(args)
    spec = PlanSpec(
        model=model,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu=gpu,
        host=host,
        dtype=DTYPES[args.dtype],
        stage=args.stage,
        reduce_dtype=DTYPES[args.reduce_dtype],
        optimizer=args.optimizer,
        bucket_numel=args.bucket_numel,
        params_on="checkpoint" if args.params_on == "meta" else args.params_on,
        grouping=args.grouping,
        tier=args.tier,
        host_ram_bytes=None if args.host_ram_gib is None else int(args.host_ram_gib * 2**30),
        reserved_bytes=int(args.reserved_gib * 2**30),
        grad_accum=args.grad_accum,
        host_huge_pages=args.host_huge_pages,
        offload_optimizer=args.offload_optimizer == "cpu",
        pin_memory=args.pin_memory,
        async_save=args.async_save,
    )
    return dataclasses.replace(spec, calibration=_calibration(args, spec))


def _check_output(path_text: str | None) -> None:
    """Refuse a ``--json`` path that cannot be written before the plan is computed (an
    ``OSError`` naming it: flatzero.cli.main makes it one line)."""
    if not path_text or path_text == "-":
        return
    path = Path(path_text)
    parent = path.parent
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path_text)
    if not parent.exists():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(parent))
    if not parent.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path_text)
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path_text)


def run(args: argparse.Namespace) -> int:
    """Print the plan (a table, or JSON with ``--json``)."""
    _check_output(args.json)
    plan = make_plan(spec_from_args(args))  # an error: one line from flatzero.cli.main
    data = plan_to_dict(plan)
    if args.json == "-":
        print(json.dumps(data))
        return 0
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=2))
    return 0


def run_measure(args: argparse.Namespace) -> None:
    """Measure and print this machine's rates; write them as JSON with ``--json``."""
    cal = measure(
        args.measure_mib * 2**20,
        fill_bytes=args.fill_mib * 2**20,
        ranks=args.ranks,
        settle_s=args.settle_s,
    )
    fill, cast = f"{cal.fill_bytes / 2**20:.0f} MiB", f"{cal.cast_bytes / 2**20:.0f} MiB"
    rows = [
        ("memcpy", cal.memcpy_gbps, cal.thread_memcpy_gbps, ""),
        ("new memory", cal.first_touch_gbps, cal.thread_first_touch_gbps, f" ({fill} fills)"),
        ("cast", cal.cast_gbps, cal.thread_cast_gbps, f" (bf16 -> {cast} of new fp32)"),
    ]
    print(
        f"host: {cal.cores} cores; new memory as flatzero allocates it (2 MiB pages), "
        f"{cal.ranks} process(es) at once for all cores"
    )
    for name, every, one, what in rows:
        print(f"  {name:<12} {every:7.2f} GB/s all cores, {one:6.2f} one thread{what}")
    print(
        f"  torch's allocator: new memory {cal.plain_first_touch_gbps:.2f} GB/s, "
        f"cast {cal.plain_cast_gbps:.2f} GB/s, all cores ({cast})"
    )
    if cal.device_copy_gbps is not None:
        print(
            f"  device copy  {cal.device_copy_gbps:7.2f} GB/s; pinned H2D {cal.h2d_gbps or 0:.2f}"
        )
    per_tensor = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in cal.tensor_seconds.items())
    print(f"  per tensor   {per_tensor}")
    if args.json:
        Path(args.json).write_text(json.dumps(cal.to_dict(), indent=2))
