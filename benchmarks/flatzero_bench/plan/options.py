"""The ``flatzero bench plan`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero.layout import DEFAULT_BUCKET_NUMEL
from flatzero.measure.settle import add_settle_argument
from flatzero_bench.common.options import add_dtype_argument

__all__ = ["HELP", "METHODS", "add_arguments"]

HELP = "Plan benchmark: flatzero plan's predicted CPU init time against a measured one."
"""The benchmark's line in ``flatzero bench --help``."""

METHODS = {"flatzero": "cpu", "torch_cat": "deepspeed_device", "legacy_cpu": "deepspeed_legacy"}
"""Benchmark method -> the plan's method that predicts it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench plan`` options."""
    parser.add_argument("--model", default="llama-0.4b", help="a preset or benchmark model")
    add_dtype_argument(parser)
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help="flatten bucket size (elements)",
    )
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--trials", type=int, default=3, help="timed trials per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed trials per method first")
    add_settle_argument(parser, "sleep before every trial (and calibration pass)")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated methods to time"
    )
    parser.add_argument(
        "--calibration",
        help="use these measured rates (flatzero info --measure --json) at every world size "
        "instead of measuring",
    )
    parser.add_argument("--json", help="also write the result JSON to this path")
