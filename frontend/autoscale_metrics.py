"""The autoscaler's series on the gateway's /metrics: the controller's planner decides, the
gateway (the one HTTP endpoint a deployment's Prometheus scrapes) shows what it was told.

The planner sends its whole state each time (`AutoscaleSeries.update`), so a restarted gateway
shows it again after the planner's next pass; counters are the planner's own running totals.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class AutoscaleSeries(Collector):
    """Owns the last state the planner sent; renders it as three families:
    `splitserve_autoscale_decisions_total{pool,direction,reason}` (decisions taken: up, down, or
    held: an up the bounds or the cluster refused), `splitserve_autoscale_desired_replicas{pool}`
    and `splitserve_autoscale_replicas{pool}` (the workers the pool runs)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._state: dict[str, Any] = {"decisions": [], "desired": {}, "actual": {}}
        registry.register(self)

    def update(self, state: Mapping[str, Any]) -> None:
        """`state`: {"decisions": [[pool, direction, reason, count], ...], "desired": {pool: n},
        "actual": {pool: n}}."""
        self._state = {key: state.get(key) or ([] if key == "decisions" else {}) for key in self._state}

    def collect(self) -> Iterator[Metric]:
        state = self._state
        decisions = CounterMetricFamily(
            "splitserve_autoscale_decisions",
            "Autoscaler decisions by pool, direction (up, down, held) and reason",
            labels=["pool", "direction", "reason"],
        )
        for pool, direction, reason, count in state["decisions"]:
            decisions.add_metric([pool, direction, reason], count)
        desired = GaugeMetricFamily(
            "splitserve_autoscale_desired_replicas", "Replicas the autoscaler wants per pool", labels=["pool"]
        )
        actual = GaugeMetricFamily(
            "splitserve_autoscale_replicas", "Replicas an autoscaled pool runs", labels=["pool"]
        )
        for family, values in ((desired, state["desired"]), (actual, state["actual"])):
            for pool, count in values.items():
                family.add_metric([pool], count)
        yield from (decisions, desired, actual)
