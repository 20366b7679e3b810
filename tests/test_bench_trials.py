"""The statistics a benchmark's trials are reduced with."""

from __future__ import annotations

import math
import random

import pytest

from flatzero.bench.trials import bracketed, median_interval


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


def test_bracketed_cancels_a_linear_drift_and_uses_one_side_at_the_ends():
    """Windows at orders 0..6 on a machine slowing by 0.5 s per window; the baseline runs at
    the even orders, a save adds 1 s to the odd ones: each is 1 s over its neighbours' mean.
    A window after the last baseline is compared with that one alone."""
    drift = [10 + 0.5 * o for o in range(8)]
    base = {o: drift[o] for o in (0, 2, 4, 6)}
    assert bracketed([1, 3, 5], [drift[o] + 1 for o in (1, 3, 5)], base) == [1.0, 1.0, 1.0]
    assert bracketed([7], [drift[7] + 1], base) == [1.5]
    with pytest.raises(ValueError, match="no baseline"):
        bracketed([1], [1.0], {})
