"""The ``flatzero bench load`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero_bench.common.options import add_dtype_argument, add_model_argument

__all__ = ["HELP", "METHODS", "add_arguments"]

HELP = "Load benchmark: direct load into the flat buffers against a full load plus flatten."
"""The benchmark's line in ``flatzero bench --help``."""

METHODS = ("full", "direct", "direct_sharded")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flatzero bench load``."""
    add_model_argument(parser, "llama-0.4b")
    add_dtype_argument(parser)
    parser.add_argument("--world-size", type=int, default=2, help="ranks")
    parser.add_argument("--trials", type=int, default=3, help="timed trials per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed trials per method first")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated methods to time"
    )
    parser.add_argument(
        "--bucket-numel", type=int, default=2**24, help="flatten bucket size (elements)"
    )
    parser.add_argument(
        "--master", action="store_true", help="also build the fp32 master shard in every method"
    )
    parser.add_argument(
        "--workdir", default=None, help="where to write the checkpoint (default: a temp dir)"
    )
    parser.add_argument("--out", default=None, help="write the JSON result to this file")
