"""The ``flatzero bench checkpoint`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero_bench.common.options import add_dtype_argument, add_model_argument

__all__ = ["HELP", "LOAD_METHODS", "SAVE_METHODS", "WRITER_METHODS", "add_arguments"]

HELP = "Checkpoint benchmark: verified against unverified loads; step time lost to a save."
"""The benchmark's line in ``flatzero bench --help``."""

LOAD_METHODS = ("verified", "unverified")
WRITER_METHODS = ("sync", "async", "async_buffered")
SAVE_METHODS = ("sync", "async", "dcp_async")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flatzero bench checkpoint``."""
    add_model_argument(parser, "llama-0.4b")
    add_dtype_argument(parser)
    parser.add_argument("--world-size", type=int, default=2, help="ranks")
    parser.add_argument("--trials", type=int, default=5, help="timed trials per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed trials per method first")
    parser.add_argument(
        "--what", default="load", choices=("load", "save", "writer"), help="what to time"
    )
    parser.add_argument(
        "--methods",
        default=None,
        help=f"comma-separated methods of --what (default: all of them): load: "
        f"{','.join(LOAD_METHODS)}; save: {','.join(SAVE_METHODS)}; writer: "
        f"{','.join(WRITER_METHODS)}",
    )
    parser.add_argument("--steps", type=int, default=3, help="steps timed after each save")
    parser.add_argument(
        "--bucket-numel", type=int, default=2**24, help="flatten bucket size (elements)"
    )
    parser.add_argument("--seq", type=int, default=16, help="tokens of a training step")
    parser.add_argument(
        "--workdir", default=None, help="where to write the checkpoints (default: a temp dir)"
    )
    parser.add_argument("--out", default=None, help="write the JSON result to this file")
