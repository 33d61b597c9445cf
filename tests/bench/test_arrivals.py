"""Arrival times: all at once for an infinite rate, a seeded gamma/Poisson process otherwise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.arrivals import arrival_offsets


def test_an_infinite_rate_sends_everything_at_the_start():
    assert arrival_offsets(5, math.inf) == [0.0] * 5


def test_a_finite_rate_is_reproducible_from_the_seed_and_starts_at_zero():
    first = arrival_offsets(100, 10.0, seed=3)
    assert first == arrival_offsets(100, 10.0, seed=3)
    assert first != arrival_offsets(100, 10.0, seed=4)
    assert first[0] == 0.0 and all(b > a for a, b in zip(first, first[1:]))


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gaps_average_one_over_the_rate_and_burstiness_sets_their_spread(burstiness):
    gaps = np.diff(arrival_offsets(20_001, 50.0, burstiness, seed=1))
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    # A gamma with shape k has coefficient of variation 1/sqrt(k) (1 for Poisson arrivals).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="request rate must be positive"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness must be positive"):
        arrival_offsets(3, 1.0, burstiness=0.0)
