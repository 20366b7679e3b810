"""What the benchmarks' options share, with no torch behind them.

[Note: a benchmark's options import no torch]
``flatzero bench --help``, ``flatzero bench NAME --help`` and an argument error answer
without importing torch (seconds): ``flatzero_bench.commands`` builds the parser from each
benchmark's ``options`` module, which imports only this module, ``argparse``, flatzero's
torch-free rooms (``layout``, ``measure.settle``) and names of the harness's torch-free trial
scripts; a benchmark's own module is imported when it runs. Names whose home imports torch
are spelled here as names only (the models' keys, the dtypes'), each checked against its
home by ``tests/test_cli.py``; a default that torch decides (``--device``: cuda when torch
sees a GPU) is None here and decided when the benchmark runs (``ranks.device_or_default``).
"""

from __future__ import annotations

import argparse

__all__ = [
    "BENCH_DTYPE_NAMES",
    "MODEL_NAMES",
    "STEP_MODEL_NAMES",
    "add_dtype_argument",
    "add_model_argument",
]

BENCH_DTYPE_NAMES = ("bf16", "fp32")
"""The params' dtypes the benchmarks run, short names (``settings.BENCH_DTYPES`` maps them
to torch dtypes)."""

MODEL_NAMES = (
    "llama-0.4b",
    "llama-3-8b",
    "qwen3-30b-a3b-16l-fused",
    "qwen3-30b-a3b-16l-unfused",
    "qwen3-moe-narrow-fused",
    "qwen3-moe-narrow-unfused",
    "qwen3-moe-small-fused",
    "qwen3-moe-small-unfused",
    "tiny",
)
"""The keys of ``flatzero.models.bench_models.MODELS``, sorted (``--model`` of init, load,
checkpoint, doors, device-memory)."""

STEP_MODEL_NAMES = ("llama-0.4b", "llama-22m", "tiny")
"""The keys of ``flatzero.models.bench_models.STEP_MODELS``, sorted (``bench step --model``)."""


def add_model_argument(
    parser: argparse.ArgumentParser, default: str, names: tuple[str, ...] = MODEL_NAMES
) -> None:
    """``--model``: one of ``names``, ``default`` unless given."""
    parser.add_argument("--model", default=default, choices=names, help="the benchmark model")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: the params' training dtype, one of ``BENCH_DTYPE_NAMES`` (bf16 unless
    given)."""
    parser.add_argument(
        "--dtype", default="bf16", choices=BENCH_DTYPE_NAMES, help="training dtype of the params"
    )
