"""The gateway's prefix-cache series, on the gateway's registry (`/metrics`).

Two views. The gateway's own, from every Prefill response: prompt tokens sent (queried) and
served from a cache (hit), as counters. The engines', from each prefill worker's
`Prefill.CacheReport`: its counters since its engine started, as gauges per worker (a worker
restart starts them again from 0, which a gauge may do and a counter may not). Hits there are
split by tier: `engine` (the worker's own cache) and `store` (imported from a state store); and
the last of its prefix events this gateway applied (its cursor: several gateways agree on it once
each has read the worker's report).
"""

from __future__ import annotations

import contextlib

from frontend.metrics import GatewayMetrics
from frontend.series import Counter, Gauge
from splitserve.v1 import prefill_pb2


class PrefixMetrics:
    """Owns the prefix-cache series; registered once per app on `GatewayMetrics.registry`."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.model_name = metrics.model_name
        registry = metrics.registry
        self.queried_tokens = Counter(
            "splitserve_prefix_queried_tokens",
            "Prompt tokens sent to prefill (looked up in a prefix cache), as the gateway counts them",
            ["model_name"],
            registry=registry,
        )
        self.hit_tokens = Counter(
            "splitserve_prefix_hit_tokens",
            "Prompt tokens served from a prefix cache (usage.prompt_tokens_details.cached_tokens)",
            ["model_name"],
            registry=registry,
        )
        worker = ("model_name", "worker")

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.engine_queried_tokens = gauge(
            "splitserve_engine_prefix_queried_tokens",
            "Prompt tokens the worker's engine looked up, since it started",
            *worker,
        )
        self.engine_hit_tokens = gauge(
            "splitserve_engine_prefix_hit_tokens",
            "Prompt tokens served from a prefix cache since the engine started, by tier (engine, store)",
            *worker,
            "tier",
        )
        self.engine_lost_tokens = gauge(
            "splitserve_engine_prefix_lost_to_missing_state_tokens",
            "Prompt tokens whose KV matched further than any kept KDA state snapshot, since start",
            *worker,
        )
        self.engine_snapshot_bytes = gauge(
            "splitserve_engine_prefix_snapshot_bytes",
            "Bytes of KDA state snapshots the engine keeps",
            *worker,
        )
        self.engine_snapshots = gauge(
            "splitserve_engine_prefix_snapshots", "KDA state snapshots the engine keeps", *worker
        )
        self.engine_evictions = gauge(
            "splitserve_engine_prefix_evictions",
            "Prefix cache entries evicted since the engine started",
            *worker,
        )
        self.report_seq = gauge(
            "splitserve_prefix_report_seq",
            "The last prefix event of the worker's engine this gateway applied to its routing index "
            "(its CacheReport cursor; gateways of one deployment agree once each has read it)",
            *worker,
        )

    def observe_prefill(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.queried_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.hit_tokens.labels(self.model_name).inc(num_cached_tokens)

    def forget_worker(self, worker: str) -> None:
        """Drop a worker's gauges (it left the pool): a scrape shows only workers there now."""
        labels = (self.model_name, worker)
        for gauge in self._worker_gauges():
            with contextlib.suppress(KeyError):  # never reported
                gauge.remove(*labels)
        for tier in ("engine", "store"):
            with contextlib.suppress(KeyError):
                self.engine_hit_tokens.remove(*labels, tier)

    def _worker_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.engine_queried_tokens,
            self.engine_lost_tokens,
            self.engine_snapshot_bytes,
            self.engine_snapshots,
            self.engine_evictions,
            self.report_seq,
        )

    def observe_report(self, worker: str, report: prefill_pb2.PrefixCacheReport) -> None:
        labels = (self.model_name, worker)
        self.engine_queried_tokens.labels(*labels).set(report.num_queried_tokens)
        self.engine_hit_tokens.labels(*labels, "engine").set(report.num_hit_tokens)
        self.engine_hit_tokens.labels(*labels, "store").set(report.num_imported_tokens)
        self.engine_lost_tokens.labels(*labels).set(report.num_lost_to_missing_state_tokens)
        self.engine_snapshot_bytes.labels(*labels).set(report.snapshot_bytes)
        self.engine_snapshots.labels(*labels).set(report.num_snapshots)
        self.engine_evictions.labels(*labels).set(report.num_evictions)
        self.report_seq.labels(*labels).set(report.last_seq)
