"""The gateway-overhead benchmark runs end to end on a tiny workload and reports every cell."""

from __future__ import annotations

import pytest

from experiments.gateway_overhead import main

NUM_REQUESTS = 6
CONCURRENCIES = (1, 3)
OUTPUT_LENS = (1, 4)


def test_every_request_completes_on_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--num-requests", str(NUM_REQUESTS), "--input-len", "16", "--disable-tqdm"]
    argv += ["--concurrency", *map(str, CONCURRENCIES), "--output-len", *map(str, OUTPUT_LENS)]
    cells = main(argv)
    assert [(c.output_len, c.concurrency) for c in cells] == [
        (n, c) for n in OUTPUT_LENS for c in CONCURRENCIES
    ]
    for cell in cells:
        for path in (cell.worker, cell.gateway):
            assert (path.num_completed, path.num_failed) == (NUM_REQUESTS, 0), path.errors
            assert path.num_output_tokens == NUM_REQUESTS * cell.output_len
            assert path.requests_per_s > 0
            assert 0 < path.ttft_p50_ms <= path.ttft_p99_ms
            assert path.ttft_p50_ms <= path.e2e_p50_ms
            assert path.cpu.worker_ms >= 0 and path.cpu.client_ms >= 0  # /proc: the suite runs on Linux
        assert cell.gateway.cpu.gateway_ms >= 0
        assert cell.requests_per_s_ratio > 0
    printed = capsys.readouterr().out
    assert "worker alone (gRPC)" in printed and "the gateway adds" in printed and "requests/s" in printed
    rows = [line for line in printed.splitlines() if line.lstrip()[:1].isdigit() and "|" in line]
    assert len(rows) == 2 * len(cells)  # a latency row and a throughput row each
    assert "failed" not in printed


def test_token_id_prompts_work_too() -> None:
    cells = main(
        ["--num-requests", "3", "--concurrency", "2", "--output-len", "3", "--token-ids", "--disable-tqdm"]
    )
    assert all(c.gateway.num_completed == 3 and c.worker.num_completed == 3 for c in cells)
