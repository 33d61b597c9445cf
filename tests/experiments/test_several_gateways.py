"""The several-gateways benchmark runs end to end on a tiny workload: every count measured, every
request answered, and with two processes on the port each answered some."""

from __future__ import annotations

import pytest

from experiments.several_gateways import main

NUM_REQUESTS = 40  # a new connection each: all on one of two processes has odds 2 ** -39


def test_each_count_serves_every_request_over_its_processes(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(
        ["--gateways", "1", "2", "--num-requests", str(NUM_REQUESTS), "--concurrency", "4"]
        + ["--rounds", "1", "--input-len", "16", "--idle-s", "0.2"]
    )
    assert [row.num_gateways for row in rows] == [1, 2]
    for row in rows:
        assert (row.figures.num_completed, row.figures.num_failed) == (NUM_REQUESTS, 0), row.figures.errors
        assert len(row.served) == row.num_gateways and sum(row.served) == NUM_REQUESTS
        assert min(row.served) > 0, row.served
        assert row.gateways_ms > 0 and row.client_ms > 0  # read from /proc: the suite runs on Linux
    assert rows[1].ledger_ms >= 0  # the ledger's process is metered when there is one
    printed = capsys.readouterr().out
    assert "gateway CPU ms/req" in printed and "median over the rounds" in printed
