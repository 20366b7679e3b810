"""The ``flatzero bench muon`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments"]

HELP = "Muon benchmark: Newton-Schulz work per rank, flatzero's owners against DeepSpeed's ZeRO-2."
"""The benchmark's line in ``flatzero bench --help``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench muon`` options."""
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated ranks to run")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    parser.add_argument(
        "--methods", default="flatzero,deepspeed", help="comma-separated: flatzero, deepspeed"
    )
    parser.add_argument("--out", default=None, help="write the result as JSON here")
