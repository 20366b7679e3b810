"""How a benchmark orders its trials and reduces them over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["rotated", "slowest_per_trial"]

_Item = TypeVar("_Item")


def rotated(items: Sequence[_Item], shift: int) -> list[_Item]:
    """``items`` starting at index ``shift`` (modulo their count), wrapping around: trial
    ``i`` runs the methods ``rotated(methods, i)``, so none always comes first, as the one
    that meets the memory the previous trial freed."""
    k = shift % len(items)
    return [*items[k:], *items[:k]]


def slowest_per_trial(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per trial, the largest figure over ranks (``per_rank[rank][trial]``, seconds or any
    figure where the slowest rank counts); every rank has the same number of trials."""
    return [max(trial) for trial in zip(*per_rank, strict=True)]
