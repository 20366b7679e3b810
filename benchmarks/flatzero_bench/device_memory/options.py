"""The ``flatzero bench device-memory`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero.layout import DEFAULT_BUCKET_NUMEL
from flatzero_bench.common.options import add_dtype_argument, add_model_argument

__all__ = ["HELP", "add_arguments"]

HELP = "Peak device memory and bytes moved at init: flatzero against DeepSpeed's torch.cat."
"""The benchmark's line in ``flatzero bench --help``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench device-memory`` options."""
    add_model_argument(parser, "tiny")
    add_dtype_argument(parser)
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument(
        "--device",
        help="accelerator type: emu (the emulated one, CPU memory) or cuda (default: cuda "
        "when torch sees a GPU, else emu)",
    )
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help="flatten bucket size (elements)",
    )
    parser.add_argument(
        "--capacity-gib", type=float, default=64.0, help="emulated device memory per rank"
    )
    parser.add_argument("--json", help="also write the result JSON to this path")
