"""The ``flatzero bench`` subcommands: each benchmark's name, options and module.

Only the benchmarks' ``options`` modules are imported here (no torch: see
``common.options``); a benchmark's module is imported when it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType

from flatzero_bench.checkpoint import options as checkpoint_options
from flatzero_bench.device_memory import options as device_memory_options
from flatzero_bench.doors import options as doors_options
from flatzero_bench.host_ops import options as host_ops_options
from flatzero_bench.init import options as init_options
from flatzero_bench.load import options as load_options
from flatzero_bench.muon import options as muon_options
from flatzero_bench.offload import options as offload_options
from flatzero_bench.plan import options as plan_options
from flatzero_bench.step import options as step_options

__all__ = ["BENCHMARKS", "add_benchmarks"]

BENCHMARKS: tuple[tuple[str, ModuleType, str], ...] = (
    ("init", init_options, "flatzero_bench.init.init_bench"),
    ("step", step_options, "flatzero_bench.step.step"),
    ("load", load_options, "flatzero_bench.load.load_bench"),
    ("checkpoint", checkpoint_options, "flatzero_bench.checkpoint.checkpoint_bench"),
    ("doors", doors_options, "flatzero_bench.doors.doors"),
    ("plan", plan_options, "flatzero_bench.plan.plan_bench"),
    ("device-memory", device_memory_options, "flatzero_bench.device_memory.device_memory"),
    ("offload", offload_options, "flatzero_bench.offload.offload_bench"),
    ("muon", muon_options, "flatzero_bench.muon.muon_bench"),
    ("host-ops", host_ops_options, "flatzero_bench.host_ops.host_ops"),
)
"""``flatzero bench NAME``: (name, its options module: ``HELP`` and
``add_arguments(parser)``, the module whose ``run(args)`` runs it)."""


def add_benchmarks(
    bench: argparse.ArgumentParser,
    command: Callable[..., None],
) -> None:
    """Add every benchmark to the ``flatzero bench`` parser ``bench``, through the CLI's
    ``command(subparsers, name, help, add_arguments, run)`` (``run`` as
    ``"module:run"``, imported once the command line parsed)."""
    sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, options, module in BENCHMARKS:
        command(sub, name, options.HELP, options.add_arguments, f"{module}:run")
