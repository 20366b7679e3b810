"""Where ``flatzero bench`` and ``flatzero demo`` find the benchmark harness.

The harness (``flatzero_bench``: every benchmark, its baselines, trials and tables) is no
part of the product's distribution: it lives in ``benchmarks/flatzero_bench`` of a source
checkout. An installed ``flatzero_bench`` is used as it is; otherwise the ``benchmarks/``
folder beside the ``src/`` this flatzero was imported from joins ``sys.path`` (an editable
install or ``PYTHONPATH=src`` in a checkout: ``./scripts/setup.sh`` needs nothing more).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["HARNESS", "find_harness", "harness_missing"]

HARNESS = "flatzero_bench"
"""The harness's import name."""


def _checkout_folder() -> Path:
    """``benchmarks/`` of the source checkout this flatzero would come from."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def find_harness() -> bool:
    """Make ``flatzero_bench`` importable; False when neither installed nor in a checkout.

    A folder added to ``sys.path`` reaches the ranks ``run_ranks`` spawns (``spawn`` passes
    ``sys.path`` on); the harness puts it on its own child processes' ``PYTHONPATH``.
    """
    if importlib.util.find_spec(HARNESS) is not None:
        return True
    folder = _checkout_folder()
    if not (folder / HARNESS / "__init__.py").is_file():
        return False
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    return importlib.util.find_spec(HARNESS) is not None


def harness_missing(command: str) -> FileNotFoundError:
    """The error of ``command`` (``"flatzero bench"``) run without the harness."""
    return FileNotFoundError(
        f"{command} needs the benchmark harness ({HARNESS}), which lives in benchmarks/ of "
        f"a source checkout and is not installed with flatzero: not found in "
        f"{_checkout_folder()}; run it from a clone (git clone, then ./scripts/setup.sh)"
    )
