"""Several runs' summaries side by side: one row per figure, one column per deployment, ratios.

`comparison_rows(summaries)` lists the figures (counts, throughputs, goodput, the prefix cache
hit rate, then mean, median, p90 and p99 of TTFT, TPOT, ITL and E2E latency, and of TTFT over
multi-turn sessions' later turns); `format_comparison(labels, summaries)` prints
them as a table whose last columns divide each deployment's figure by the first deployment's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.metrics import LatencyStats, Summary

_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
_STATS = (("mean_ms", "mean"), ("median_ms", "median"), ("p90_ms", "p90"), ("p99_ms", "p99"))


@dataclass(frozen=True)
class ComparisonRow:
    """One figure across deployments: its name, each deployment's value (None: no samples), and
    whether it is a count (printed without decimals)."""

    name: str
    values: tuple[float | None, ...]
    is_count: bool = False

    @property
    def ratios(self) -> tuple[float | None, ...]:
        """Each deployment after the first divided by the first; None where either is missing or
        the first is zero."""
        base = self.values[0]
        return tuple(
            None if base is None or value is None or base == 0 else value / base for value in self.values[1:]
        )


def comparison_rows(summaries: Sequence[Summary]) -> list[ComparisonRow]:
    """Every figure of `summaries` (at least one), in table order; goodput only where an SLO was set."""
    if not summaries:
        raise ValueError("nothing to compare: no summaries")

    def row(name: str, value: Callable[[Summary], float | None], is_count: bool = False) -> ComparisonRow:
        return ComparisonRow(name, tuple(value(s) for s in summaries), is_count)

    rows = [
        row("Successful requests", lambda s: s.completed, is_count=True),
        row("Failed requests", lambda s: s.failed, is_count=True),
        row("Benchmark duration (s)", lambda s: s.duration_s),
        row("Request throughput (req/s)", lambda s: s.request_throughput_rps),
        row("Output token throughput (tok/s)", lambda s: s.output_throughput_tps),
        row("Total token throughput (tok/s)", lambda s: s.total_token_throughput_tps),
    ]
    if any(s.goodput_rps is not None for s in summaries):
        rows.append(row("Request goodput (req/s)", lambda s: s.goodput_rps))
    if any(s.prefix_hit_rate is not None for s in summaries):
        rows.append(row("Prefix cache hit rate (%)", _percent))
    for attribute, short in _LATENCIES:
        for field, stat in _STATS:
            rows.append(row(f"{short} {stat} (ms)", _latency(attribute, field)))
    if any(s.ttft_later_turns.count for s in summaries):
        for field, stat in _STATS:
            rows.append(row(f"TTFT {stat}, turns 2+ (ms)", _latency("ttft_later_turns", field)))
    return rows


def _percent(summary: Summary) -> float | None:
    return None if summary.prefix_hit_rate is None else 100 * summary.prefix_hit_rate


def format_comparison(labels: Sequence[str], summaries: Sequence[Summary]) -> str:
    """The rows as a text table: a column per label, then one `label/first` ratio column per other label."""
    if len(labels) != len(summaries):
        raise ValueError(f"{len(labels)} labels for {len(summaries)} summaries")
    rows = comparison_rows(summaries)
    header = ["", *labels, *(f"{label}/{labels[0]}" for label in labels[1:])]
    body = [
        [r.name, *(_value(v, r.is_count) for v in r.values), *(_ratio(q) for q in r.ratios)] for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [_line(header, widths)]
    lines.append("-" * len(lines[0]))
    lines += [_line(line, widths) for line in body]
    slos = next((s.slos_ms for s in summaries if s.slos_ms), None)
    if slos:
        lines.append("Goodput SLOs: " + ", ".join(f"{name} <= {limit:g} ms" for name, limit in slos.items()))
    return "\n".join(lines)


def _latency(attribute: str, field: str) -> Callable[[Summary], float | None]:
    def value(summary: Summary) -> float | None:
        stats: LatencyStats = getattr(summary, attribute)
        return getattr(stats, field)  # type: ignore[no-any-return]

    return value


def _value(value: float | None, is_count: bool) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if is_count else f"{value:,.2f}"


def _ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    first, *rest = cells
    return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:]))])
