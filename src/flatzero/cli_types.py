"""Argument types of the command line (no torch): every count bounded up front, so one number can
never drive unbounded work (argparse turns a refusal into one usage line, exit code 2)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

__all__ = ["MAX_WORLD_SIZE", "count", "parse_size"]

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


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1e9"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B?)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB, 1000000)")
    value = float(m.group(1))
    unit = (m.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    scale |= {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    if unit not in scale:
        raise argparse.ArgumentTypeError(f"unknown unit in {text!r}")
    return max(1, int(value * scale[unit]))
