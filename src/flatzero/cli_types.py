"""Argument types of the command line: every count bounded up front, so one number can
never drive unbounded work (argparse turns a refusal into one usage line, exit code 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["MAX_WORLD_SIZE", "count"]

MAX_WORLD_SIZE = 65536
"""The largest world size a command accepts (beyond the largest data-parallel jobs)."""


def count(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number in ``[low, high]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    parse.__name__ = "count"
    return parse
