"""A benchmark's result: its head (which benchmark, the command, the date) and where it goes
(a JSON file on request, and always one JSON line on stdout, last)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from flatzero_bench.common.provenance import command_line, utc_timestamp

__all__ = ["emit", "print_skipped", "result_head"]


def result_head(benchmark: str, args: argparse.Namespace) -> dict[str, Any]:
    """``{"benchmark", "command", "date"}``: the first keys of every result."""
    return {"benchmark": benchmark, "command": command_line(args), "date": utc_timestamp()}


def print_skipped(skipped: Mapping[str, str]) -> None:
    """One line per method or door left out, with why."""
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")


def emit(result: dict[str, Any], path: str | None) -> None:
    """Write ``result`` to ``path`` (indented JSON) when given; print it as one JSON line."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
