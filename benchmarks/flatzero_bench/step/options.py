"""The ``flatzero bench step`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero_bench.common.options import STEP_MODEL_NAMES, add_model_argument

__all__ = ["HELP", "add_arguments"]

HELP = "Step benchmark: ZeroOptimizer's training step against plain AdamW and DeepSpeed ZeRO."
"""The benchmark's line in ``flatzero bench --help``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench step`` options."""
    add_model_argument(parser, "llama-22m", STEP_MODEL_NAMES)
    parser.add_argument("--dtypes", default="fp32", help="comma-separated of fp32, bf16")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--stages", default="2", help="ZeRO stages to compare, e.g. 1,2")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method")
    parser.add_argument(
        "--bucket-numel", type=int, default=2**22, help="reduce/all-gather bucket elements"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where the model lives (default: cuda when torch sees a GPU, else cpu)",
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed")
    parser.add_argument(
        "--no-fused-baselines",
        action="store_true",
        help="skip the baselines with torch's fused AdamW (flatzero uses it by default)",
    )
    parser.add_argument("--json", help="also write the result JSON to this path")
    parser.add_argument("--markdown", help="also write the table (markdown) to this path")
