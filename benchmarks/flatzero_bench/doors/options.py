"""The ``flatzero bench doors`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero_bench.common.options import add_model_argument
from flatzero_bench.doors.door_trial import DOORS

__all__ = ["HELP", "add_arguments"]

HELP = "Door against door: flatzero.initialize vs deepspeed.initialize, one torchrun launch each."
"""The benchmark's line in ``flatzero bench --help``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench doors`` options."""
    add_model_argument(parser, "llama-0.4b")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument(
        "--settle-s",
        default="0,6",
        help="modes, comma-separated: seconds to pause before every launch; 0 is back to "
        "back, 6 lets the machine take freed memory back (default: 0,6, both modes)",
    )
    parser.add_argument("--runs", type=int, default=3, help="repeats of the whole alternation")
    parser.add_argument("--trials", type=int, default=3, help="launches per door per run")
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed launches of each door per world size first"
    )
    parser.add_argument(
        "--doors", default=",".join(DOORS), help="comma-separated of " + ", ".join(DOORS)
    )
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2], help="ZeRO stage")
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=2**26,
        help="reduce_bucket_size and allgather_bucket_size in the config, elements (even)",
    )
    parser.add_argument(
        "--seq",
        type=int,
        default=2,
        help="tokens in the first step's batch (default 2, one predicted token: a CPU without "
        "AVX-512 runs bf16 matmuls in a slow fallback, and the forward and backward, the same "
        "for both doors, would otherwise bury what the doors do differently)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model init and batch seed")
    parser.add_argument(
        "--limit-repeats", type=int, default=2, help="first-touch passes per limit (best kept)"
    )
    parser.add_argument(
        "--launch-timeout-s",
        type=float,
        default=1800,
        help="seconds before a launch counts as hung",
    )
    parser.add_argument("--json", help="also write the result JSON to this path")
    parser.add_argument("--plot", help="also draw the figures to this image (needs matplotlib)")
