"""The gateway-overhead benchmark's figures and the two tables it prints.

`PathFigures` is one path's run (worker alone, or through the gateway); `Cell` puts both side
by side at one output length and concurrency. `latency_table` shows TTFT and end-to-end p50/p99
of both and what the gateway adds; `throughput_table` shows requests/s, their ratio, and the
CPU each process spent per request, which says where the gateway path's time goes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CpuPerRequest:
    """CPU milliseconds (user + system, all threads) each process spent per completed request."""

    worker_ms: float
    gateway_ms: float
    client_ms: float


NO_CPU = CpuPerRequest(math.nan, math.nan, math.nan)


@dataclass(frozen=True)
class PathFigures:
    """One path's run: how many requests completed, how fast, their latency percentiles, CPU."""

    num_completed: int
    num_failed: int
    duration_s: float
    num_output_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    errors: tuple[str, ...] = ()  # the first few failures' messages
    cpu: CpuPerRequest = NO_CPU

    @classmethod
    def of(
        cls, samples: Sequence[tuple[float, float, int]], errors: Sequence[str], duration_s: float
    ) -> PathFigures:
        """From (ttft_s, e2e_s, output_tokens) of each completed request and each failure's text."""
        ttft = [1e3 * s[0] for s in samples] or [math.nan]
        e2e = [1e3 * s[1] for s in samples] or [math.nan]
        ttft_p50, ttft_p99 = np.percentile(ttft, [50, 99])
        e2e_p50, e2e_p99 = np.percentile(e2e, [50, 99])
        return cls(
            num_completed=len(samples),
            num_failed=len(errors),
            duration_s=duration_s,
            num_output_tokens=sum(s[2] for s in samples),
            ttft_p50_ms=float(ttft_p50),
            ttft_p99_ms=float(ttft_p99),
            e2e_p50_ms=float(e2e_p50),
            e2e_p99_ms=float(e2e_p99),
            errors=tuple(errors[:3]),
        )

    @property
    def requests_per_s(self) -> float:
        return self.num_completed / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class Cell:
    """Both paths at one output length and concurrency, and what the gateway adds."""

    output_len: int
    concurrency: int
    worker: PathFigures
    gateway: PathFigures

    @property
    def added_ms(self) -> tuple[float, float, float, float]:
        """TTFT p50, TTFT p99, E2E p50, E2E p99 through the gateway minus the worker alone's."""
        w, g = self.worker, self.gateway
        return (
            g.ttft_p50_ms - w.ttft_p50_ms,
            g.ttft_p99_ms - w.ttft_p99_ms,
            g.e2e_p50_ms - w.e2e_p50_ms,
            g.e2e_p99_ms - w.e2e_p99_ms,
        )

    @property
    def requests_per_s_ratio(self) -> float:
        """Gateway requests/s over the worker alone's (1.0 = the gateway costs nothing)."""
        return self.gateway.requests_per_s / self.worker.requests_per_s if self.worker.requests_per_s else 0.0


# Tables ------------------------------------------------------------------------------------------

Block = tuple[str, tuple[tuple[str, int], ...]]  # a title over (column name, width) pairs
_CELL: Block = ("", (("output", 6), ("concur", 6)))
_LATENCY = (("TTFT p50", 8), ("p99", 7), ("E2E p50", 8), ("p99", 7))


def _table(blocks: Sequence[Block], rows: Sequence[Sequence[Sequence[float | str]]]) -> str:
    """Blocks of right-aligned columns under centred titles; each row gives one tuple per block."""
    names = [" ".join(f"{name:>{width}}" for name, width in columns) for _, columns in blocks]
    titles = [f"{title:^{len(n)}}" for (title, _), n in zip(blocks, names)]
    lines = [" | ".join(titles).rstrip(), " | ".join(names)]
    for row in rows:
        cells = []
        for (_, columns), values in zip(blocks, row):
            cells.append(" ".join(_fmt(v, width) for v, (_, width) in zip(values, columns)))
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def _fmt(value: float | str, width: int) -> str:
    return f"{value:>{width}}" if isinstance(value, str) else f"{value:>{width}.2f}"


def latency_table(cells: Sequence[Cell]) -> str:
    """Milliseconds: TTFT and E2E p50/p99 of each path, and the gateway's difference."""
    blocks: list[Block] = [
        _CELL,
        ("worker alone (gRPC)", _LATENCY),
        ("through the gateway (HTTP)", _LATENCY),
        ("the gateway adds", _LATENCY),
    ]
    rows = []
    for c in cells:
        w, g = c.worker, c.gateway
        added = tuple(f"{ms:+.2f}" for ms in c.added_ms)
        rows.append(
            (
                (str(c.output_len), str(c.concurrency)),
                (w.ttft_p50_ms, w.ttft_p99_ms, w.e2e_p50_ms, w.e2e_p99_ms),
                (g.ttft_p50_ms, g.ttft_p99_ms, g.e2e_p50_ms, g.e2e_p99_ms),
                added,
            )
        )
    return _table(blocks, rows)


def throughput_table(cells: Sequence[Cell]) -> str:
    """Requests/s of each path and their ratio; CPU ms per request of every process on each path."""
    blocks: list[Block] = [
        _CELL,
        ("requests/s", (("alone", 7), ("gateway", 7), ("ratio", 6))),
        ("CPU ms/req, alone", (("worker", 6), ("client", 6))),
        ("CPU ms/req, through the gateway", (("gateway", 7), ("worker", 6), ("client", 6))),
    ]
    rows = []
    for c in cells:
        w, g = c.worker, c.gateway
        rows.append(
            (
                (str(c.output_len), str(c.concurrency)),
                (f"{w.requests_per_s:.0f}", f"{g.requests_per_s:.0f}", f"{c.requests_per_s_ratio:.2f}x"),
                (w.cpu.worker_ms, w.cpu.client_ms),
                (g.cpu.gateway_ms, g.cpu.worker_ms, g.cpu.client_ms),
            )
        )
    return _table(blocks, rows)


def failures(cells: Sequence[Cell]) -> str:
    """One line per path that lost requests, with an example error; empty when none did."""
    lines = []
    for c in cells:
        for name, p in (("worker alone", c.worker), ("through the gateway", c.gateway)):
            if p.num_failed:
                example = p.errors[0] if p.errors else "?"
                lines.append(
                    f"output {c.output_len}, concurrency {c.concurrency}, {name}: "
                    f"{p.num_failed} failed, e.g. {example}"
                )
    return "\n".join(lines)
