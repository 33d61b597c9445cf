"""A result round-trips through JSON exactly; the table shows every figure, '-' where none."""

from __future__ import annotations

import json

from bench.metrics import summarize
from bench.records import RequestRecord
from bench.report import format_summary
from bench.result import BenchmarkResult

RECORDS = (
    RequestRecord(
        0, True, 0.0, 5, 3, 3, ttft_s=0.1, itl_s=(0.01, 0.02), e2e_s=0.13, session_id=0, turn_index=0
    ),
    RequestRecord(1, False, 0.2, 5, 3, error="HTTP 500: boom", session_id=0, turn_index=1),
)


def test_a_result_round_trips_through_json(tmp_path):
    result = BenchmarkResult(
        dataset="multi-turn",
        started_at="2026-01-01T00:00:00+00:00",
        summary=summarize(RECORDS, 1.0, {"ttft": 200}),
        records=RECORDS,
        arguments={"request_rate": float("inf"), "seed": 1},
    )
    loaded = BenchmarkResult.load(result.save(tmp_path / "r.json"))
    assert loaded.records == result.records and loaded.summary == result.summary
    assert loaded.arguments == {"request_rate": "inf", "seed": 1}  # JSON has no infinity
    data = json.loads(result.to_json())
    assert data["requests"][0]["tpot_s"] == 0.015 and data["requests"][1]["error"] == "HTTP 500: boom"


def test_the_table_shows_counts_goodput_and_dashes_for_metrics_without_samples():
    table = format_summary(summarize(RECORDS[1:], 1.0, {"e2el": 1000}))
    lines = table.splitlines()
    assert lines[1].split() == ["Successful", "requests:", "0"] and lines[2].split() == [
        "Failed",
        "requests:",
        "1",
    ]
    assert "Goodput SLOs: e2el <= 1000 ms" in lines
    assert any(line.split() == ["Mean", "TTFT", "(ms):", "-"] for line in lines)
    assert all(len(line) <= 50 for line in lines)
