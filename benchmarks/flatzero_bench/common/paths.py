"""What a benchmark's child process needs on ``PYTHONPATH``: this flatzero and this harness."""

from __future__ import annotations

import os
from pathlib import Path

import flatzero
import flatzero_bench

__all__ = ["with_import_paths"]


def with_import_paths(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``PYTHONPATH`` led by the folders this flatzero and this harness were
    imported from (a checkout's ``src/`` and ``benchmarks/``), so that a child process
    imports the same code as its parent; returns ``env``."""
    roots = (Path(flatzero.__file__), Path(flatzero_bench.__file__))
    first = [str(path.resolve().parents[1]) for path in roots]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, env.get("PYTHONPATH")) if p)
    return env
