"""Percentiles over the last window from cumulative histogram buckets, as Prometheus'
`histogram_quantile(rate(...))` does: the difference of two snapshots, then linear
interpolation inside the bucket the rank falls in.

A snapshot is [(upper bound, cumulative count)], bounds ascending, the last "+Inf"
(frontend/load_report.py). Several gateways' snapshots add up bound by bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Buckets = Sequence[tuple[float | str, float]]


def add(snapshots: Iterable[Buckets]) -> list[tuple[float, float]]:
    """Several gateways' buckets summed per bound (+Inf as `float("inf")`)."""
    total: dict[float, float] = {}
    for snapshot in snapshots:
        for bound, count in snapshot:
            total[float(bound)] = total.get(float(bound), 0.0) + count
    return sorted(total.items())


def difference(now: Buckets, before: Buckets | None) -> list[tuple[float, float]]:
    """`now` less `before`, bound by bound. A count that went down (a gateway restarted and
    started again from zero) makes the whole of `now` the window."""
    current = add([now])
    if before is None:
        return current
    earlier = dict(add([before]))
    window = [(bound, count - earlier.get(bound, 0.0)) for bound, count in current]
    if any(count < 0 for _, count in window):
        return current
    return window


def quantile(window: Sequence[tuple[float, float]], percentile: float) -> float | None:
    """The `percentile` (0-100) of the observations in `window` (cumulative counts per upper
    bound), interpolated linearly in its bucket; None with no observation. A rank in the +Inf
    bucket gives the highest finite bound (all that is known: "at least that")."""
    if not window or window[-1][1] <= 0:
        return None
    rank = window[-1][1] * percentile / 100.0
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in window:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            inside = count - lower_count
            share = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound
