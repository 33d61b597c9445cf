"""A run's summary, computed from its request records: latency percentiles, throughput, goodput.

Definitions follow `vllm bench serve`: TTFT is the first content chunk's arrival after the
send, E2E latency the stream's end after the send, TPOT `(E2E - TTFT) / (output_tokens - 1)` for
requests with more than one output token, and ITL every gap between successive content chunks,
pooled over all requests. Percentiles interpolate linearly (`numpy.percentile`). Only successful
requests count towards latencies, token totals and throughputs. The prefix cache hit rate is the
server's `usage.prompt_tokens_details.cached_tokens` over the prompt tokens of the requests that
reported it; `ttft_later_turns` is TTFT over the turns after the first of multi-turn sessions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bench.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, p90 and p99 of one latency metric, in milliseconds; None when it has no samples."""

    count: int = 0
    mean_ms: float | None = None
    median_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> LatencyStats:
        if not values_s:
            return cls()
        values_ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        median, p90, p99 = np.percentile(values_ms, [50, 90, 99])
        return cls(len(values_ms), float(values_ms.mean()), float(median), float(p90), float(p99))


@dataclass(frozen=True)
class Summary:
    """The headline numbers of one run; rates are per second of `duration_s`.

    `goodput_rps` is the rate of successful requests that met every SLO in `slos_ms`
    (None when no SLO was given).
    """

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput_rps: float
    output_throughput_tps: float
    total_token_throughput_tps: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    goodput_rps: float | None = None
    slos_ms: dict[str, float] = field(default_factory=dict)
    total_cached_tokens: int | None = None  # None: no request's usage said
    prefix_hit_rate: float | None = None
    ttft_later_turns: LatencyStats = field(default_factory=LatencyStats)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        values = dict(data)
        for name in ("ttft", "tpot", "itl", "e2el", "ttft_later_turns"):
            if name in values:  # results written before ttft_later_turns existed lack it
                values[name] = LatencyStats(**values[name])
        return cls(**values)


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slos_ms: Mapping[str, float] | None = None
) -> Summary:
    """The summary of `records` over a run of `duration_s`; `slos_ms` maps ttft/tpot/e2el to limits."""
    slos = dict(slos_ms or {})
    check_slo_names(slos)
    done = [r for r in records if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if meets_slos(r, slos))
    reported = [r for r in done if r.cached_tokens is not None]
    cached_tokens = sum(r.cached_tokens or 0 for r in reported) if reported else None
    reported_prompt_tokens = sum(r.prompt_tokens for r in reported)
    return Summary(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput_rps=_rate(len(done), duration_s),
        output_throughput_tps=_rate(output_tokens, duration_s),
        total_token_throughput_tps=_rate(input_tokens + output_tokens, duration_s),
        ttft=LatencyStats.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=LatencyStats.of_seconds([t for t in (r.tpot_s for r in done) if t is not None]),
        itl=LatencyStats.of_seconds([gap for r in done for gap in r.itl_s]),
        e2el=LatencyStats.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
        goodput_rps=_rate(good, duration_s) if slos else None,
        slos_ms=slos,
        total_cached_tokens=cached_tokens,
        prefix_hit_rate=None if cached_tokens is None else _rate(cached_tokens, reported_prompt_tokens),
        ttft_later_turns=LatencyStats.of_seconds(
            [r.ttft_s for r in done if r.ttft_s is not None and (r.turn_index or 0) > 0]
        ),
    )


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """Whether a successful `record` is within every limit; a single-token output passes any TPOT limit."""
    if not record.success:
        return False
    values_s = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s}
    for name, limit_ms in slos_ms.items():
        value_s = values_s[name]
        if value_s is None or value_s * 1000.0 > limit_ms:
            return False
    return True


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """`["ttft:200", "tpot:50"]` as `{"ttft": 200.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep:
            raise ValueError(f"goodput SLO {spec!r}: write it as METRIC:MILLISECONDS, e.g. ttft:200")
        try:
            limit_ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if limit_ms < 0:
            raise ValueError(f"goodput SLO {spec!r}: the limit must not be negative")
        slos[name] = limit_ms
    check_slo_names(slos)
    return slos


def check_slo_names(slos: Mapping[str, float]) -> None:
    """Raise ValueError naming any SLO metric other than ttft, tpot and e2el."""
    for name in slos:
        if name not in SLO_METRICS:
            raise ValueError(f"goodput SLO metric {name!r} is unknown; use {', '.join(SLO_METRICS)}")


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0
