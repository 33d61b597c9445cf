"""The gateway's Prometheus metrics, on a registry of its own (several apps may share a process).

Latencies are measured at the gateway (what a client sees); queue and transfer times come from
the workers' own timings in the Prefill response and the first decode delta.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from frontend.series import Counter, Gauge, Histogram

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (1, 8, 32, 128, 512, 2048, 8192, 32768, 131072)
_BYTE_BUCKETS = tuple(float(1 << shift) for shift in range(10, 41, 2))  # 1 KiB .. 1 TiB
# The store as the cluster's prefix cache: (its StoreStats field, series, help), gauges per store.
_STORE_PREFIX_SERIES = (
    (
        "num_prefix_lookups",
        "splitserve_store_prefix_lookups",
        "Prefix lookups the store answered since it started",
    ),
    ("num_prefix_hit_tokens", "splitserve_store_prefix_hit_tokens", "Prompt tokens its prefix hits covered"),
    (
        "num_prefix_evictions",
        "splitserve_store_prefix_evictions",
        "Retained prefixes it dropped since it started",
    ),
    ("num_prefix_keys", "splitserve_store_prefix_entries", "Retained prefixes the store holds"),
    ("num_prefix_bytes", "splitserve_store_prefix_bytes", "Bytes of retained prefixes the store holds"),
)


class GatewayMetrics:
    """Owns the registry and every series; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        histogram, counter, gauge, lat = self._histogram, self._counter, self._gauge, _LATENCY_BUCKETS_S
        self.ttft = histogram("splitserve_time_to_first_token_seconds", "Arrival to first token", lat)
        self.itl = histogram("splitserve_inter_token_latency_seconds", "Gap between output tokens", lat)
        self.e2e = histogram("splitserve_e2e_request_latency_seconds", "Arrival to last token", lat)
        self.queue = histogram("splitserve_queue_time_seconds", "Time queued on a worker", lat, "phase")
        self.transfer_s = histogram(
            "splitserve_state_transfer_seconds",
            "State handoff not overlapped with compute (prefill put tail + decode wait)",
            lat,
        )
        self.transfer_stream_s = histogram(
            "splitserve_state_stream_seconds",
            "Whole state stream per request: first layer queued on the prefill to the store's ack",
            lat,
        )
        self.transfer_bytes = histogram(
            "splitserve_state_transfer_bytes", "State bytes handed from prefill to decode", _BYTE_BUCKETS
        )
        self.prompt_tokens_hist = histogram(
            "splitserve_request_prompt_tokens", "Prompt tokens", _TOKEN_BUCKETS
        )
        self.generation_tokens_hist = histogram(
            "splitserve_request_generation_tokens", "Generated tokens", _TOKEN_BUCKETS
        )
        self.prompt_tokens = counter("splitserve_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("splitserve_generation_tokens", "Tokens generated")
        self.requests = counter(
            "splitserve_request_success",
            "Finished generations by finish reason (stop, length, abort, error)",
            "finish_reason",
        )
        self.responses = counter(
            "splitserve_http_responses", "HTTP responses by route and status code", "route", "status_code"
        )
        self.refusals = counter(
            "splitserve_request_refusals",
            "Requests answered with an error status instead of tokens, by reason",
            "reason",
        )
        self.prefill_fallbacks = counter(
            "splitserve_prefill_fallbacks",
            "Requests that found the prefill pool empty, by prefill.fallback (decode_local: prefilled "
            "on their decode worker; fail: refused with 503)",
            "policy",
        )
        self.prefill_retries = counter(
            "splitserve_prefill_retries",
            "Prompts whose prefill failed for want of its worker or that worker's store, run again "
            "on another prefill worker or through prefill.fallback",
        )
        self.local_prefills = counter(
            "splitserve_local_prefills",
            "Prompts offered to a decode worker to prefill itself (router.local_prefill_max_tokens), "
            "by outcome (served; refused: its cache held less than believed, sent to a prefill worker)",
            "outcome",
        )
        self.decode_failovers = counter(
            "splitserve_decode_failovers",
            "Streams whose decode worker was lost, by outcome (resumed, failed, disabled, exhausted) "
            "and method (stored_state: rebuilt from the lost worker's stored state; reprefill: prompt + "
            "tokens sent prefilled again)",
            "outcome",
            "method",
        )
        self.running = gauge("splitserve_num_requests_running", "Generations in flight", ["model_name"])
        self.workers = gauge("splitserve_num_workers", "Workers known to the router", ["model_name", "role"])
        self.store_bytes = gauge(
            "splitserve_store_usage_bytes", "State store bytes in use", ["store", "tier"]
        )
        self.store_capacity = gauge(
            "splitserve_store_capacity_bytes", "State store capacity", ["store", "tier"]
        )
        self.store_prefix = {field: gauge(name, doc, ["store"]) for field, name, doc in _STORE_PREFIX_SERIES}

    # Every series but the store gauges is per model_name (several gateways may share a Prometheus).
    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...], *extra: str) -> Histogram:
        return Histogram(name, doc, ["model_name", *extra], buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, *extra: str) -> Counter:
        return Counter(name, doc, ["model_name", *extra], registry=self.registry)

    def _gauge(self, name: str, doc: str, label_names: list[str]) -> Gauge:
        return Gauge(name, doc, label_names, registry=self.registry)

    def labels(self) -> dict[str, str]:
        return {"model_name": self.model_name}

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, num_generated_tokens: int) -> None:
        self.requests.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(num_generated_tokens)
        self.prompt_tokens_hist.labels(self.model_name).observe(num_prompt_tokens)
        self.generation_tokens_hist.labels(self.model_name).observe(num_generated_tokens)

    def observe_response(self, route: str, status_code: int) -> None:
        self.responses.labels(self.model_name, route, str(status_code)).inc()

    def observe_refusal(self, reason: str) -> None:
        """One request answered with an error; `reason` comes from a fixed set in the code (error
        codes), never from the request, so the series stay bounded."""
        self.refusals.labels(self.model_name, reason).inc()

    def set_workers(self, num_prefill: int, num_decode: int) -> None:
        self.workers.labels(self.model_name, "prefill").set(num_prefill)
        self.workers.labels(self.model_name, "decode").set(num_decode)

    def set_store_usage(self, store: str, tier: str, num_bytes: int, capacity_bytes: int) -> None:
        """Hook for whoever reads store Stats (the gateway's refresher, or a controller)."""
        self.store_bytes.labels(store, tier).set(num_bytes)
        self.store_capacity.labels(store, tier).set(capacity_bytes)

    def set_store_prefix(self, store: str, stats: object) -> None:
        """The store's prefix-cache counters from its Stats reply (`num_prefix_*`), per store."""
        for field, series in self.store_prefix.items():
            series.labels(store).set(getattr(stats, field))

    def render(self) -> bytes:
        return generate_latest(self.registry)
