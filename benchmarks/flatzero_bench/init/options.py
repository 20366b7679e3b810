"""The ``flatzero bench init`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero.layout import DEFAULT_BUCKET_NUMEL
from flatzero.measure.settle import add_settle_argument
from flatzero_bench.common.options import add_dtype_argument, add_model_argument

__all__ = ["DEFAULT_METHODS", "HELP", "METHODS", "add_arguments"]

HELP = (
    "Init benchmark: flatzero's flatten + master shard against DeepSpeed's and the hardware limit."
)
"""The benchmark's line in ``flatzero bench --help``."""

METHODS = ("flatzero", "flatzero_4k", "torch_cat", "legacy_cpu", "deepspeed")
"""``flatzero_4k``: flatzero with ``FlattenConfig(host_huge_pages=False)``."""
DEFAULT_METHODS = ("flatzero", "torch_cat", "legacy_cpu", "deepspeed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench init`` options."""
    add_model_argument(parser, "llama-0.4b")
    add_dtype_argument(parser)
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--trials", type=int, default=3, help="timed trials per method")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds of every method first (a VM backs fresh memory on first touch)",
    )
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated of {', '.join(METHODS)}",
    )
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help="flatten bucket size (elements)",
    )
    parser.add_argument("--tier", default="auto", help="flatzero's tier (default: auto)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where the model lives (default: cuda when torch sees a GPU, else cpu)",
    )
    parser.add_argument(
        "--params-on",
        default="host",
        choices=["host", "pinned", "device"],
        help="where the params are before init (device: on the GPU)",
    )
    parser.add_argument("--no-lm-head", action="store_true", help="base model only")
    add_settle_argument(
        parser,
        "seconds to sleep before every trial so each starts from cold memory, as at a "
        "job's start (10 on the development VM, docs/plan.md); default: back to back",
    )
    parser.add_argument("--json", help="also write the result JSON to this path")
