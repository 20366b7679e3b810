"""How a benchmark orders its trials and reduces them over ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

__all__ = ["bracketed", "median_interval", "rotated", "slowest_per_trial"]

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


def median_interval(values: Sequence[float], confidence: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free interval for the median of what ``values`` sample (independent
    draws of one quantity): ``(low, high, coverage)``, order statistics ``k`` from each end
    with the largest ``k`` whose coverage (from the binomial distribution of how many
    draws fall under the median) is at least ``confidence``; too few values for that give
    ``(min, max)`` and the smaller coverage they do have.

    Raises:
        ValueError: ``values`` is empty.
    """
    n = len(values)
    if n == 0:
        raise ValueError("no values to take the median of")
    ordered = sorted(values)

    def coverage(k: int) -> float:  # P(x_(k) <= median <= x_(n-k+1)), 1-indexed
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def bracketed(order: Sequence[int], walls: Sequence[float], base: dict[int, float]) -> list[float]:
    """Each window's seconds minus the baseline at its place in the run: the baseline
    windows run right before and right after it (``base``: run order -> seconds),
    interpolated linearly in run order (the one side where the other is missing). A slow
    drift of the machine's speed cancels to first order, where a mean over the whole run
    keeps it. Windows between the same two baseline windows share them, so their
    differences are not fully independent.

    Raises:
        ValueError: ``base`` is empty.
    """
    if not base:
        raise ValueError("no baseline windows")
    out = []
    for at, wall in zip(order, walls, strict=True):
        before = max((o for o in base if o < at), default=None)
        after = min((o for o in base if o > at), default=None)
        if before is None or after is None:
            expected = base[after if before is None else before]
        else:
            weight = (at - before) / (after - before)
            expected = base[before] + weight * (base[after] - base[before])
        out.append(wall - expected)
    return out
