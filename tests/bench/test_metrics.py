"""Metric arithmetic on recorded timings, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from bench.client import StreamResult
from bench.metrics import LatencyStats, meets_slos, parse_slos, summarize
from bench.records import RequestRecord, count_output_tokens


def record(
    index: int, ttft_s: float, itl_s: list[float], output_tokens: int, prompt_tokens: int = 10
) -> RequestRecord:
    e2e_s = ttft_s + sum(itl_s)
    return RequestRecord(
        index=index,
        success=True,
        start_s=0.0,
        prompt_tokens=prompt_tokens,
        max_tokens=output_tokens,
        output_tokens=output_tokens,
        ttft_s=ttft_s,
        itl_s=tuple(itl_s),
        e2e_s=e2e_s,
    )


def failed(index: int) -> RequestRecord:
    return RequestRecord(
        index=index, success=False, start_s=0.0, prompt_tokens=99, max_tokens=7, error="HTTP 500: x"
    )


def test_a_record_from_a_stream_measures_ttft_itl_and_e2e_from_the_send():
    stream = StreamResult(
        send_s=100.0, end_s=100.9, chunk_s=(100.2, 100.5, 100.6), text="abc", completion_tokens=3
    )
    r = RequestRecord.from_stream(stream, index=4, benchmark_start_s=99.0, prompt_tokens=12, max_tokens=3)
    assert r.success and r.index == 4
    assert r.start_s == pytest.approx(1.0)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.itl_s == pytest.approx((0.3, 0.1))
    assert r.e2e_s == pytest.approx(0.9)
    assert r.tpot_s == pytest.approx((0.9 - 0.2) / 2)
    assert r.prompt_tokens == 12 and r.output_tokens == 3


def test_server_usage_wins_over_the_dataset_prompt_length_and_local_counts():
    stream = StreamResult(send_s=0.0, end_s=1.0, chunk_s=(0.5,), prompt_tokens=40, completion_tokens=9)
    r = RequestRecord.from_stream(stream, index=0, benchmark_start_s=0.0, prompt_tokens=12, max_tokens=9)
    assert (r.prompt_tokens, r.output_tokens) == (40, 9)


def test_output_tokens_fall_back_to_the_tokenizer_then_to_the_chunk_count(tokenizer):
    stream = StreamResult(send_s=0.0, end_s=1.0, chunk_s=(0.1, 0.2), text=" the cat the cat")
    assert count_output_tokens(stream, tokenizer) == len(
        tokenizer.encode(" the cat the cat", add_special_tokens=False)
    )
    assert count_output_tokens(stream, None) == 2


def test_a_failed_stream_keeps_its_error_and_has_no_latencies():
    stream = StreamResult(send_s=5.0, end_s=5.5, error="HTTP 400: bad")
    r = RequestRecord.from_stream(stream, index=1, benchmark_start_s=4.0, prompt_tokens=3, max_tokens=2)
    assert not r.success and r.error == "HTTP 400: bad"
    assert r.ttft_s is None and r.e2e_s is None and r.itl_s == () and r.tpot_s is None


def test_stats_interpolate_percentiles_linearly():
    stats = LatencyStats.of_seconds([0.001, 0.002, 0.003, 0.004, 0.010])
    assert stats.count == 5
    assert stats.mean_ms == pytest.approx(4.0)
    assert stats.median_ms == pytest.approx(3.0)
    # rank 0.9 * 4 = 3.6: 4 + 0.6 * (10 - 4); rank 0.99 * 4 = 3.96: 4 + 0.96 * 6
    assert stats.p90_ms == pytest.approx(7.6)
    assert stats.p99_ms == pytest.approx(9.76)
    assert stats.p99_ms == pytest.approx(float(np.percentile([1, 2, 3, 4, 10], 99)))


def test_stats_without_samples_are_none():
    assert LatencyStats.of_seconds([]) == LatencyStats(0, None, None, None, None)


def test_summary_pools_itl_over_requests_and_excludes_failures_and_single_token_tpot():
    records = [
        record(0, ttft_s=0.100, itl_s=[0.010, 0.030], output_tokens=3, prompt_tokens=10),
        record(1, ttft_s=0.300, itl_s=[0.020], output_tokens=2, prompt_tokens=20),
        record(2, ttft_s=0.200, itl_s=[], output_tokens=1, prompt_tokens=30),
        failed(3),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s.completed, s.failed) == (3, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (60, 6)
    assert s.request_throughput_rps == pytest.approx(1.5)
    assert s.output_throughput_tps == pytest.approx(3.0)
    assert s.total_token_throughput_tps == pytest.approx(33.0)
    assert (
        s.ttft.count == 3
        and s.ttft.mean_ms == pytest.approx(200.0)
        and s.ttft.median_ms == pytest.approx(200.0)
    )
    # TPOT: (0.14 - 0.1) / 2 = 20 ms and (0.32 - 0.3) / 1 = 20 ms; the single-token request has none.
    assert s.tpot.count == 2 and s.tpot.mean_ms == pytest.approx(20.0)
    # ITL pools every gap: 10, 30, 20 ms.
    assert (
        s.itl.count == 3 and s.itl.mean_ms == pytest.approx(20.0) and s.itl.median_ms == pytest.approx(20.0)
    )
    assert s.itl.p90_ms == pytest.approx(28.0)  # rank 0.9 * 2 = 1.8 over [10, 20, 30]: 20 + 0.8 * 10
    assert s.e2el.count == 3 and s.e2el.mean_ms == pytest.approx((140 + 320 + 200) / 3)
    assert s.goodput_rps is None


def test_goodput_counts_successes_within_every_slo_of_each_kind():
    fast = record(0, ttft_s=0.050, itl_s=[0.010] * 4, output_tokens=5)  # tpot 10 ms, e2e 90 ms
    slow_first = record(1, ttft_s=0.500, itl_s=[0.010] * 4, output_tokens=5)  # e2e 540 ms
    slow_decode = record(2, ttft_s=0.050, itl_s=[0.100] * 4, output_tokens=5)  # tpot 100 ms, e2e 450 ms
    one_token = record(3, ttft_s=0.050, itl_s=[], output_tokens=1)
    records = [fast, slow_first, slow_decode, one_token, failed(4)]
    assert summarize(records, 1.0, {"ttft": 100}).goodput_rps == pytest.approx(3.0)
    assert summarize(records, 1.0, {"tpot": 50}).goodput_rps == pytest.approx(3.0)  # one_token passes TPOT
    assert summarize(records, 1.0, {"e2el": 500}).goodput_rps == pytest.approx(3.0)
    both = summarize(records, 2.0, {"ttft": 100, "tpot": 50})
    assert both.goodput_rps == pytest.approx(1.0) and both.slos_ms == {"ttft": 100, "tpot": 50}
    assert not meets_slos(failed(5), {})


def test_a_slo_at_exactly_the_measured_value_is_met():
    r = record(0, ttft_s=0.25, itl_s=[0.25], output_tokens=2)
    assert meets_slos(r, {"ttft": 250.0, "tpot": 250.0, "e2el": 500.0})


def test_zero_duration_gives_zero_rates_not_a_division_error():
    s = summarize([record(0, 0.1, [0.1], 2)], duration_s=0.0, slos_ms={"ttft": 1000})
    assert s.request_throughput_rps == 0.0 and s.goodput_rps == 0.0


def test_slo_specs_parse_to_milliseconds_and_bad_ones_say_what_is_wrong():
    assert parse_slos(["ttft:200", "tpot:12.5", "e2el:3000"]) == {"ttft": 200.0, "tpot": 12.5, "e2el": 3000.0}
    with pytest.raises(ValueError, match="'itl' is unknown; use ttft, tpot, e2el"):
        parse_slos(["itl:5"])
    with pytest.raises(ValueError, match="METRIC:MILLISECONDS"):
        parse_slos(["ttft"])
    with pytest.raises(ValueError, match="'fast' is not a number"):
        parse_slos(["ttft:fast"])
