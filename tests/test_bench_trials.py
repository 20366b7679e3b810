"""The statistics a benchmark's trials are reduced with."""

from __future__ import annotations

import math
import random

import pytest

from flatzero_bench.common.trials import bracketed, median_interval


def test_median_interval_takes_the_widest_order_statistics_that_keep_the_coverage():
    """12 values: the 3rd smallest and the 3rd largest (coverage 1 - 2 P(B(12, 1/2) <= 2)
    = 0.961; one further in would cover only 0.854, under 0.9)."""
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 11.0, 2.0, 8.0, 4.0, 12.0, 6.0, 10.0]
    low, high, coverage = median_interval(values)
    assert (low, high) == (3.0, 10.0)
    assert coverage == pytest.approx(1 - 2 * sum(math.comb(12, i) for i in range(3)) / 2**12)
    assert median_interval(values, confidence=0.99)[:2] == (2.0, 11.0)


def test_median_interval_of_too_few_values_is_their_range_with_its_true_coverage():
    assert median_interval([2.0, 1.0, 3.0]) == (1.0, 3.0, 0.75)
    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_median_interval_covers_the_median_as_often_as_it_says():
    """Draws of an exponential (median ln 2): the interval holds it in at least its
    coverage of 2000 samples of 10 (less 3 standard errors)."""
    rng = random.Random(0)
    held, runs = 0, 2000
    for _ in range(runs):
        low, high, coverage = median_interval([rng.expovariate(1.0) for _ in range(10)])
        held += low <= math.log(2) <= high
    assert coverage == pytest.approx(0.9785, abs=1e-4)
    assert held / runs >= coverage - 3 * math.sqrt(coverage * (1 - coverage) / runs)


def test_bracketed_cancels_a_linear_drift_wherever_the_window_sits_between_baselines():
    """Windows at orders 0..9 on a machine slowing by 0.5 s per window; the baseline runs
    at orders 0, 3, 4 and 8 (unevenly spaced, as rotated methods place them), a save adds
    1 s to the others: each reads exactly 1 s, the plain mean of the two neighbours would
    not (order 1: 0.5 s off). A window after the last baseline is compared with that one
    alone."""
    drift = [10 + 0.5 * o for o in range(10)]
    base = {o: drift[o] for o in (0, 3, 4, 8)}
    saves = [1, 2, 5, 6, 7]
    assert bracketed(saves, [drift[o] + 1 for o in saves], base) == pytest.approx([1.0] * 5)
    assert bracketed([9], [drift[9] + 1], base) == [1.5]
    with pytest.raises(ValueError, match="no baseline"):
        bracketed([1], [1.0], {})
