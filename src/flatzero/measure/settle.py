"""The ``--settle-s`` option of the commands that write new memory (``flatzero plan
--measure``, the benchmarks)."""

from __future__ import annotations

import argparse

__all__ = ["add_settle_argument"]


def add_settle_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, text: str
) -> None:
    """``--settle-s``: seconds (float, default 0: back to back) to wait before writing new
    memory, so that the machine has taken freed memory back, as at a job's start; ``text``
    is its help."""
    parser.add_argument("--settle-s", type=float, default=0.0, help=text)
