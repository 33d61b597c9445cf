"""`bench compare`'s table, ratios, JSON and plots, from hand-made request records."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from bench.compare_output import comparison_text, write_comparison
from bench.compare_run import DeploymentOutcome
from bench.compare_table import ComparisonRow, comparison_rows, format_comparison
from bench.metrics import summarize
from bench.records import RequestRecord
from bench.result import BenchmarkResult

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LATENCY_ROWS = [f"{m} {s} (ms)" for m in ("TTFT", "TPOT", "ITL", "E2EL") for s in ("mean", "median", "p90", "p99")]  # fmt: skip
SLOS = {"ttft": 150.0}


def record(index: int, ttft_s: float, gap_s: float, num_tokens: int = 4) -> RequestRecord:
    """A successful request: `num_tokens` chunks, the first after `ttft_s`, then one every `gap_s`."""
    return RequestRecord(
        index=index,
        success=True,
        start_s=0.0,
        prompt_tokens=10,
        max_tokens=num_tokens,
        output_tokens=num_tokens,
        ttft_s=ttft_s,
        itl_s=(gap_s,) * (num_tokens - 1),
        e2e_s=ttft_s + gap_s * (num_tokens - 1),
    )


def failed(index: int) -> RequestRecord:
    return RequestRecord(
        index=index, success=False, start_s=0.0, prompt_tokens=10, max_tokens=4, error="HTTP 500"
    )


def result(records: list[RequestRecord], duration_s: float) -> BenchmarkResult:
    return BenchmarkResult(
        "random", "2025-01-01T00:00:00+00:00", summarize(records, duration_s, SLOS), tuple(records)
    )


@pytest.fixture
def baseline() -> BenchmarkResult:
    # 4 requests in 2 s, TTFT 100/200 ms (2 meet the 150 ms SLO), 20 ms between tokens.
    return result(
        [record(0, 0.1, 0.02), record(1, 0.1, 0.02), record(2, 0.2, 0.02), record(3, 0.2, 0.02)], 2.0
    )


@pytest.fixture
def faster() -> BenchmarkResult:
    # 3 of 4 complete in 1 s, TTFT 50 ms (all meet the SLO), 10 ms between tokens.
    return result([record(0, 0.05, 0.01), record(1, 0.05, 0.01), record(2, 0.05, 0.01), failed(3)], 1.0)


def cells(table: str, row_name: str) -> list[str]:
    """The cells after the row name on the table line that starts with it."""
    (line,) = [line for line in table.splitlines() if line.startswith(row_name + " ")]
    return line[len(row_name) :].split()


def test_the_table_has_every_row_a_column_per_deployment_and_a_ratio_column(baseline, faster):
    table = format_comparison(["colocated", "disagg"], [baseline.summary, faster.summary])
    header = table.splitlines()[0].split()
    assert header == ["colocated", "disagg", "disagg/colocated"]
    names = [row.name for row in comparison_rows([baseline.summary, faster.summary])]
    expected = ["Successful requests", "Failed requests", "Benchmark duration (s)", "Request throughput (req/s)",
                "Output token throughput (tok/s)", "Total token throughput (tok/s)", "Request goodput (req/s)",
                *LATENCY_ROWS]  # fmt: skip
    assert names == expected
    for name in expected:
        assert len(cells(table, name)) == 3, name
    assert "Goodput SLOs: ttft <= 150 ms" in table


def test_ratios_divide_each_deployment_by_the_first(baseline, faster):
    table = format_comparison(["a", "b"], [baseline.summary, faster.summary])
    assert cells(table, "Successful requests") == ["4", "3", "0.75x"]
    assert cells(table, "Failed requests") == ["0", "1", "-"]  # the baseline's 0 gives no ratio
    assert cells(table, "Request throughput (req/s)") == ["2.00", "3.00", "1.50x"]
    assert cells(table, "Output token throughput (tok/s)") == ["8.00", "12.00", "1.50x"]
    assert cells(table, "Request goodput (req/s)") == ["1.00", "3.00", "3.00x"]
    assert cells(table, "TTFT mean (ms)") == ["150.00", "50.00", "0.33x"]
    assert cells(table, "TPOT median (ms)") == ["20.00", "10.00", "0.50x"]
    assert cells(table, "ITL p99 (ms)") == ["20.00", "10.00", "0.50x"]
    assert cells(table, "E2EL p90 (ms)") == ["260.00", "80.00", "0.31x"]


def test_three_deployments_get_two_ratio_columns_and_missing_values_no_ratio(baseline, faster):
    empty = result([failed(0)], 1.0)  # no latencies at all
    table = format_comparison(["a", "b", "c"], [baseline.summary, faster.summary, empty.summary])
    assert table.splitlines()[0].split() == ["a", "b", "c", "b/a", "c/a"]
    assert cells(table, "TTFT p99 (ms)")[2:] == ["-", "0.25x", "-"]
    assert ComparisonRow("x", (0.0, 1.0)).ratios == (None,)
    assert ComparisonRow("x", (2.0, None, 3.0)).ratios == (None, 1.5)


def test_no_goodput_row_without_slos():
    plain = summarize([record(0, 0.1, 0.02)], 1.0)
    assert "Request goodput (req/s)" not in [row.name for row in comparison_rows([plain, plain])]
    assert "Goodput" not in format_comparison(["a", "b"], [plain, plain])


def assert_png(path) -> None:
    assert path.read_bytes()[: len(PNG_SIGNATURE)] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 100 and width > 100


def test_the_output_folder_holds_each_result_the_comparison_and_valid_pngs(baseline, faster, tmp_path):
    outcomes = [
        DeploymentOutcome("colocated", "c.yaml", "done", result=baseline, gateway_url="http://127.0.0.1:1"),
        DeploymentOutcome("broken", "b.yaml", "start", error="not healthy after 5 s"),
        DeploymentOutcome("disagg", "d.yaml", "done", result=faster, gateway_url="http://127.0.0.1:2"),
    ]
    files = write_comparison(outcomes, tmp_path / "out", {"seed": 0, "request_rate": float("inf")})
    assert BenchmarkResult.load(files.results["colocated"]) == baseline
    assert BenchmarkResult.load(files.results["disagg"]) == faster
    assert sorted(p.name for p in files.plots) == ["latency_cdf.png", "throughput.png"]
    for plot in files.plots:
        assert_png(plot)

    doc = json.loads(files.comparison.read_text())
    assert doc["format"] == "splitserve-bench-compare/1" and doc["baseline"] == "colocated"
    assert doc["arguments"] == {"seed": 0, "request_rate": "inf"}
    assert [(d["label"], d["stage"], d["result_file"]) for d in doc["deployments"]] == [
        ("colocated", "done", "colocated.json"), ("broken", "start", None), ("disagg", "done", "disagg.json")
    ]  # fmt: skip
    assert doc["deployments"][1]["error"] == "not healthy after 5 s"
    assert doc["deployments"][2]["summary"]["completed"] == 3
    throughput = next(r for r in doc["rows"] if r["name"] == "Request throughput (req/s)")
    assert throughput == {"name": "Request throughput (req/s)", "values": {"colocated": 2.0, "disagg": 3.0},
                          "ratios": {"disagg": 1.5}}  # fmt: skip

    text = comparison_text(outcomes)
    assert text.splitlines()[0].split() == ["colocated", "disagg", "disagg/colocated"]
    assert "broken: did not start: not healthy after 5 s" in text


def test_labels_become_safe_distinct_file_names(baseline, tmp_path):
    outcomes = [
        DeploymentOutcome("a/b", "x.yaml", "done", result=baseline),
        DeploymentOutcome("a b", "y.yaml", "done", result=baseline),
        DeploymentOutcome("comparison", "z.yaml", "done", result=baseline),
    ]
    files = write_comparison(outcomes, tmp_path, {})
    assert {label: p.name for label, p in files.results.items()} == {
        "a/b": "a_b.json", "a b": "a_b-2.json", "comparison": "comparison-result.json"
    }  # fmt: skip
    assert json.loads(files.comparison.read_text())["format"] == "splitserve-bench-compare/1"


def test_nothing_ran_writes_the_comparison_without_plots(tmp_path):
    outcomes = [DeploymentOutcome("a", "a.yaml", "config", error="a.yaml: cannot read the config file")]
    files = write_comparison(outcomes, tmp_path, {})
    assert files.plots == () and files.results == {}
    doc = json.loads(files.comparison.read_text())
    assert doc["baseline"] is None and doc["rows"] == [] and doc["deployments"][0]["stage"] == "config"
    assert "a: config did not load: a.yaml: cannot read" in comparison_text(outcomes)
