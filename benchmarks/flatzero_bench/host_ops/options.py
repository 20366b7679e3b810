"""The ``flatzero bench host-ops`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

__all__ = ["BUCKET_NUMEL", "HELP", "add_arguments"]

HELP = (
    "Host-ops benchmark: torch operator calls per param in backward and per step, flatzero "
    "against plain torch and DeepSpeed ZeRO."
)
"""The benchmark's line in ``flatzero bench --help``."""

BUCKET_NUMEL = 2**20
"""``--bucket-numel``'s default: ``flatzero.testing.host_ops.HostOpsSpec``'s."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench host-ops`` options."""
    parser.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated, e.g. 1,2")
    parser.add_argument("--layers", default="50,200", help="comma-separated Linear layer counts")
    parser.add_argument("--width", type=int, default=8, help="each layer's in/out features")
    parser.add_argument("--steps", type=int, default=2, help="counted steps per method")
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=BUCKET_NUMEL,
        help="flatzero's and DeepSpeed's bucket size in elements (even); the default holds "
        "every param of 200 layers of width 8 in one bucket",
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed")
    parser.add_argument("--json", help="also write the result JSON to this path")
    parser.add_argument("--markdown", help="also write the table (markdown) to this path")
