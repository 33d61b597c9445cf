"""The summary as the table a person reads at the end of a run."""

from __future__ import annotations

from bench.metrics import LatencyStats, Summary

_WIDTH = 50
_LATENCIES = (
    ("ttft", "TTFT", "Time to first token"),
    ("tpot", "TPOT", "Time per output token (excl. 1st)"),
    ("itl", "ITL", "Inter-token latency"),
    ("e2el", "E2EL", "End-to-end latency"),
)


def format_summary(summary: Summary, title: str = "Serving benchmark") -> str:
    """Counts, throughputs, then mean/median/p90/p99 of each latency, one figure a line."""
    rows: list[str] = [_rule(title, "=")]
    rows += [
        _row("Successful requests", f"{summary.completed:,}"),
        _row("Failed requests", f"{summary.failed:,}"),
        _row("Benchmark duration (s)", f"{summary.duration_s:.2f}"),
        _row("Total input tokens", f"{summary.total_input_tokens:,}"),
        _row("Total generated tokens", f"{summary.total_output_tokens:,}"),
    ]
    if summary.prefix_hit_rate is not None:
        rows.append(_row("Prefix cache hit rate (%)", f"{100 * summary.prefix_hit_rate:.1f}"))
    rows += [
        _row("Request throughput (req/s)", f"{summary.request_throughput_rps:.2f}"),
    ]
    if summary.goodput_rps is not None:
        slos = ", ".join(f"{name} <= {limit:g} ms" for name, limit in summary.slos_ms.items())
        rows.append(f"Goodput SLOs: {slos}")
        rows.append(_row("Request goodput (req/s)", f"{summary.goodput_rps:.2f}"))
    rows += [
        _row("Output token throughput (tok/s)", f"{summary.output_throughput_tps:.2f}"),
        _row("Total token throughput (tok/s)", f"{summary.total_token_throughput_tps:.2f}"),
    ]
    for attribute, short, long in _LATENCIES:
        rows.append(_rule(long, "-"))
        rows += _latency_rows(short, getattr(summary, attribute))
    if summary.ttft_later_turns.count:
        rows.append(_rule("TTFT of turns after the first", "-"))
        rows += _latency_rows("TTFT", summary.ttft_later_turns)
    rows.append("=" * _WIDTH)
    return "\n".join(rows)


def _latency_rows(short: str, stats: LatencyStats) -> list[str]:
    figures = (
        ("Mean", stats.mean_ms),
        ("Median", stats.median_ms),
        ("P90", stats.p90_ms),
        ("P99", stats.p99_ms),
    )
    return [
        _row(f"{label} {short} (ms)", "-" if value is None else f"{value:.2f}") for label, value in figures
    ]


def _rule(text: str, fill: str) -> str:
    return f" {text} ".center(_WIDTH, fill)


def _row(label: str, value: str) -> str:
    return f"{label + ':':<{_WIDTH - 12}}{value:>12}" if len(label) < _WIDTH - 13 else f"{label}: {value}"
