"""The options of ``flatzero plan`` and ``flatzero info``: argument definitions only, with
no torch behind them, so that ``--help`` and an argument error answer at once (the commands
import ``flatzero.plan.cli`` when they run)."""

from __future__ import annotations

import argparse

from ..cli_types import MAX_WORLD_SIZE, count
from ..layout import DEFAULT_BUCKET_NUMEL
from ..measure.settle import add_settle_argument
from .hardware import GPUS, HOSTS
from .names import DEFAULT_FILL_BYTES, GROUPINGS, OPTIMIZER_STATES, PARAMS_ON

__all__ = ["DTYPES", "GPU_FIELDS", "add_arguments", "add_info_arguments"]

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""``--dtype`` and ``--reduce-dtype``: the short name -> the torch name."""

GPU_FIELDS = {
    "gpu_memory_gib": ("memory_bytes", 2**30),
    "hbm_gbps": ("hbm_gbps", 1),
    "pcie_gbps": ("pcie_gbps", 1),
    "nvlink_gbps": ("intra_node_gbps", 1),
    "network_gbps": ("network_gbps", 1),
}
"""Each ``--gpu`` override: (the ``GpuSpec`` field it sets, its scale to that field's unit)."""


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
    for flag in GPU_FIELDS:
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
