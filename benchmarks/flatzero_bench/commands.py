"""The ``flatzero bench`` subcommands: each benchmark's name and module."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType

from flatzero_bench.checkpoint import checkpoint_bench
from flatzero_bench.device_memory import device_memory
from flatzero_bench.doors import doors
from flatzero_bench.host_ops import host_ops
from flatzero_bench.init import init_bench
from flatzero_bench.load import load_bench
from flatzero_bench.muon import muon_bench
from flatzero_bench.offload import offload_bench
from flatzero_bench.plan import plan_bench
from flatzero_bench.step import step

__all__ = ["BENCHMARKS", "add_benchmarks"]

BENCHMARKS: tuple[tuple[str, ModuleType], ...] = (
    ("init", init_bench),
    ("step", step),
    ("load", load_bench),
    ("checkpoint", checkpoint_bench),
    ("doors", doors),
    ("plan", plan_bench),
    ("device-memory", device_memory),
    ("offload", offload_bench),
    ("muon", muon_bench),
    ("host-ops", host_ops),
)
"""``flatzero bench NAME``: each module has ``add_arguments(parser)`` and ``run(args)``,
and its docstring's first line is its help."""


def add_benchmarks(
    bench: argparse.ArgumentParser,
    command: Callable[..., None],
) -> None:
    """Add every benchmark to the ``flatzero bench`` parser ``bench``, through the CLI's
    ``command(subparsers, name, help, add_arguments, run)``."""
    sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, module in BENCHMARKS:
        command(sub, name, module.__doc__.splitlines()[0], module.add_arguments, module.run)
