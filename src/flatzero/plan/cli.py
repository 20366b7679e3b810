"""``flatzero plan`` and ``flatzero info --measure``."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
from pathlib import Path

from ..cli_types import MAX_WORLD_SIZE, count
from ..config import DEFAULT_BUCKET_NUMEL
from ..cores import usable_cores
from ..measure.settle import add_settle_argument
from .calibration import DEFAULT_FILL_BYTES, Calibration, measure
from .hardware import GPUS, HOSTS, GpuSpec, get_gpu, get_host
from .memory_model import OPTIMIZER_STATES
from .model_source import GROUPINGS, resolve_model
from .planner import PARAMS_ON, PlanSpec, make_plan, new_memory_sizes
from .report import format_plan, plan_to_dict

__all__ = ["add_arguments", "add_info_arguments", "run", "run_measure", "spec_from_args"]

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_GPU_FIELDS = {
    "gpu_memory_gib": ("memory_bytes", 2**30),
    "hbm_gbps": ("hbm_gbps", 1),
    "pcie_gbps": ("pcie_gbps", 1),
    "nvlink_gbps": ("intra_node_gbps", 1),
    "network_gbps": ("network_gbps", 1),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero plan`` options, in groups: the model, the cluster, the training job,
    init and the output."""
    _add_model_arguments(parser.add_argument_group("model"))
    _add_cluster_arguments(parser.add_argument_group("cluster"))
    _add_training_arguments(parser.add_argument_group("training"))
    _add_init_arguments(parser.add_argument_group("init"))
    _add_output_arguments(parser.add_argument_group("output"))


def _add_model_arguments(group: argparse._ArgumentGroup) -> None:
    """Which model: a preset or a config, and changes to its shape."""
    group.add_argument(
        "--model",
        required=True,
        help="a zoo preset (llama-3-8b, llama-3-70b, qwen3-30b-a3b), a benchmark model "
        "(qwen3-moe-narrow-unfused, ...), a config.json or a model directory holding one "
        "(any causal LM transformers builds, when it is installed)",
    )
    group.add_argument("--layers", type=count(1, 100_000), help="replace num_hidden_layers")
    group.add_argument(
        "--expert-layout",
        choices=["fused", "unfused"],
        help="MoE expert weights as transformers 5.x (fused) or 4.x stores them",
    )
    group.add_argument("--no-lm-head", action="store_true", help="the base model (AutoModel)")


def _add_cluster_arguments(group: argparse._ArgumentGroup) -> None:
    """The cluster's shape and the figures of its GPUs and hosts."""
    group.add_argument("--nodes", type=count(1, MAX_WORLD_SIZE), default=1, help="nodes in the job")
    group.add_argument(
        "--gpus-per-node", type=count(1, 1024), default=8, help="GPUs (ranks) per node"
    )
    group.add_argument("--gpu", default="h100", help=f"{', '.join(GPUS)}, or none (CPUs only)")
    for flag in _GPU_FIELDS:
        group.add_argument(
            f"--{flag.replace('_', '-')}", type=float, help="override this figure of --gpu"
        )
    group.add_argument("--host", default="dgx-h100", help=f"host figures: {', '.join(HOSTS)}")
    group.add_argument("--host-ram-gib", type=float, help="host RAM per node (GiB)")
    group.add_argument(
        "--host-bandwidth", type=float, help="host copy bandwidth per node (GB/s), e.g. measured"
    )


def _add_training_arguments(group: argparse._ArgumentGroup) -> None:
    """The training job: dtypes, ZeRO stage, optimizer and its offload, buckets, saves."""
    group.add_argument(
        "--dtype", default="bf16", choices=sorted(DTYPES), help="training dtype of the params"
    )
    group.add_argument("--stage", type=int, default=2, choices=[1, 2], help="ZeRO stage")
    group.add_argument(
        "--reduce-dtype",
        default="fp32",
        choices=sorted(DTYPES),
        help="the dtype gradients are summed in (ZeroConfig.reduce_dtype, default fp32; a "
        "DeepSpeed config without communication_data_type sums bf16 training in bf16)",
    )
    group.add_argument(
        "--optimizer",
        default="adamw",
        choices=sorted(OPTIMIZER_STATES),
        help="the optimizer (its states per element)",
    )
    group.add_argument(
        "--bucket-numel",
        type=count(1, 2**40),
        default=DEFAULT_BUCKET_NUMEL,
        help="flatten bucket size (elements)",
    )
    group.add_argument(
        "--grad-accum", type=count(1, 1_000_000), default=1, help="micro-batches per step"
    )
    group.add_argument(
        "--offload-optimizer",
        default="none",
        choices=["none", "cpu"],
        help="optimizer offload (offload_optimizer.device): cpu puts the master shard, the "
        "optimizer state and a gradient shard in host memory, and the plan states its bytes",
    )
    group.add_argument(
        "--no-pin-memory",
        dest="pin_memory",
        action="store_false",
        help="with --offload-optimizer cpu: offload_optimizer.pin_memory false",
    )
    group.add_argument(
        "--async-save",
        action="store_true",
        help="checkpoints saved asynchronously (flatzero.async_save): the plan shows the host "
        "copy each rank keeps",
    )


def _add_init_arguments(group: argparse._ArgumentGroup) -> None:
    """Init: where the params start, the tier, memory not free, and the host's rates."""
    group.add_argument(
        "--params-on",
        default="host",
        choices=[*PARAMS_ON, "meta"],
        help="where params are when init starts (meta = meta device plus a "
        "safetensors checkpoint, the same as checkpoint)",
    )
    group.add_argument(
        "--grouping",
        default="one",
        choices=GROUPINGS,
        help="how params are split into param groups",
    )
    group.add_argument("--tier", default="auto", help="the tier to request (default: auto)")
    group.add_argument(
        "--reserved-gib",
        type=float,
        default=1.0,
        help="device memory per rank not free at init (CUDA context, NCCL)",
    )
    group.add_argument(
        "--no-host-huge-pages",
        dest="host_huge_pages",
        action="store_false",
        help="plan FlattenConfig(host_huge_pages=False): host buffers from torch's allocator",
    )
    group.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's host rates first, writing new memory at this job's "
        "sizes (a bucket, the master shard) with one process per rank of a node, and use them",
    )
    add_settle_argument(
        group, "with --calibrate: sleep before each write of new memory (10: cold on a VM)"
    )
    group.add_argument(
        "--calibration", help="use rates measured by flatzero info --measure --json FILE"
    )


def _add_output_arguments(group: argparse._ArgumentGroup) -> None:
    """Where the plan goes: a table, or JSON."""
    group.add_argument(
        "--json",
        nargs="?",
        const="-",
        help="write the plan as JSON to this file (no file: print JSON only)",
    )


def _gpu(args: argparse.Namespace) -> GpuSpec | None:
    if args.gpu.lower() in ("none", "cpu"):
        return None
    gpu = get_gpu(args.gpu)
    changes = {
        field: int(value * scale) if field == "memory_bytes" else value
        for flag, (field, scale) in _GPU_FIELDS.items()
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


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero info`` options."""
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure this machine's copy rates (for flatzero plan)",
    )
    parser.add_argument(
        "--measure-mib",
        type=int,
        default=512,
        help="MiB per copy, and per cast into new memory (a master shard)",
    )
    parser.add_argument(
        "--fill-mib",
        type=int,
        default=DEFAULT_FILL_BYTES // 2**20,
        help="MiB per fill of new memory (a bucket; default: the default bucket in bf16)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="processes writing new memory at once, as the ranks of a node (default 1)",
    )
    add_settle_argument(
        parser,
        "sleep before each write of new memory (10: cold, as at a job's "
        "start on a VM that hands freed pages back)",
    )
    parser.add_argument("--json", help="with --measure: also write the rates to this file")


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
