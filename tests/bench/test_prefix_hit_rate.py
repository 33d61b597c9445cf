"""The prefix cache hit rate and the later turns' TTFT: from usage, in the summary, the report and
the comparison table."""

from __future__ import annotations

import pytest

from bench.client import StreamResult
from bench.compare_table import format_comparison
from bench.metrics import Summary, summarize
from bench.records import RequestRecord
from bench.report import format_summary
from tests.bench.fake_server import FakeOpenAI, prompt_tokens, serving
from tests.bench.test_serve_fake import RANDOM_OPTIONS, bench


def turn(index: int, turn_index: int, ttft_s: float, cached_tokens: int | None) -> RequestRecord:
    return RequestRecord(
        index=index, success=True, start_s=0.0, prompt_tokens=100, max_tokens=2, output_tokens=2,
        ttft_s=ttft_s, itl_s=(0.01,), e2e_s=ttft_s + 0.01, session_id=0, turn_index=turn_index,
        cached_tokens=cached_tokens,
    )  # fmt: skip


def test_a_record_keeps_the_servers_cached_tokens() -> None:
    stream = StreamResult(send_s=0.0, end_s=1.0, chunk_s=(0.5,), prompt_tokens=40, cached_tokens=32)
    record = RequestRecord.from_stream(stream, index=0, benchmark_start_s=0.0, prompt_tokens=40, max_tokens=1)
    assert record.cached_tokens == 32
    assert RequestRecord.from_dict(record.to_dict()) == record


def test_the_hit_rate_counts_only_requests_whose_usage_said() -> None:
    records = [turn(0, 0, 0.5, 0), turn(1, 1, 0.1, 80), turn(2, 2, 0.2, None)]
    summary = summarize(records, duration_s=1.0)
    assert summary.total_cached_tokens == 80
    assert summary.prefix_hit_rate == pytest.approx(80 / 200)
    assert summary.ttft_later_turns.count == 2
    assert summary.ttft_later_turns.median_ms == pytest.approx(150.0)
    assert Summary.from_dict(summary.to_dict()) == summary


def test_without_cached_tokens_there_is_no_hit_rate_and_old_results_still_load() -> None:
    summary = summarize([turn(0, 0, 0.5, None)], duration_s=1.0)
    assert summary.prefix_hit_rate is None and summary.total_cached_tokens is None
    old = summary.to_dict()
    for key in ("total_cached_tokens", "prefix_hit_rate", "ttft_later_turns"):
        del old[key]
    assert Summary.from_dict(old) == summary
    assert "hit rate" not in format_summary(summary)
    assert "turns 2+" not in format_comparison(["a"], [summary])


def test_the_report_and_the_comparison_show_the_hit_rate_and_later_turns() -> None:
    off = summarize([turn(0, 0, 0.5, 0), turn(1, 1, 0.4, 0)], duration_s=1.0)
    on = summarize([turn(0, 0, 0.5, 0), turn(1, 1, 0.1, 90)], duration_s=1.0)
    report = format_summary(on)
    assert "Prefix cache hit rate (%):" in report and "45.0" in report
    assert "TTFT of turns after the first" in report
    table = format_comparison(["off", "on"], [off, on]).splitlines()
    hit = next(line for line in table if line.startswith("Prefix cache hit rate (%)"))
    assert hit.split()[-3:] == ["0.00", "45.00", "-"]
    later = next(line for line in table if line.startswith("TTFT median, turns 2+ (ms)"))
    assert later.split()[-3:] == ["400.00", "100.00", "0.25x"]


def test_bench_serve_prints_the_hit_rate_from_usage(tmp_path, capsys) -> None:
    fake = FakeOpenAI(cached_tokens=lambda body: prompt_tokens(body) // 2)
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *RANDOM_OPTIONS)
    assert status == 0
    expected = sum(r.prompt_tokens // 2 for r in result.records) / sum(
        r.prompt_tokens for r in result.records
    )
    assert result.summary.prefix_hit_rate == pytest.approx(expected)
    assert f"{100 * expected:.1f}" in capsys.readouterr().out
