"""The HTTP protocol benchmark serves every request under both protocols and prints both rows."""

from __future__ import annotations

import math

import pytest

from experiments.http_protocol_overhead import main


def test_both_protocols_serve_both_patterns(capsys: pytest.CaptureFixture[str]) -> None:
    samples = main(["--num-requests", "20", "--rounds", "1"])
    assert set(samples) == {(p, k) for p in ("uvicorn", "gateway") for k in ("kept-alive", "new connection")}
    assert all(len(values) == 1 and not math.isnan(values[0]) for values in samples.values())
    printed = capsys.readouterr().out
    assert "kept-alive |" in printed and "new connection |" in printed
