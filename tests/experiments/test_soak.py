"""The soak script for a few seconds on a real local deployment: its report has every part."""

from __future__ import annotations

import json
from pathlib import Path

import ray

from experiments.soak import main


def test_a_short_soak_reports_errors_leaks_and_drift(tmp_path: Path) -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        args = [
            "--minutes",
            "0.15",
            "--concurrency",
            "3",
            "--kill-every-s",
            "3",
            "--replicas",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ]
        report = main(args)
    finally:
        ray.shutdown()
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert report["num_requests"] > 0 and sum(report["outcomes"].values()) == report["num_requests"]
    assert "pending" not in report["outcomes"], report["outcomes"]  # every request ended
    assert report["kills"] and {k["pool"] for k in report["kills"]} <= {"prefill", "decode", "store"}
    leaks = report["leaks"]
    for snap in (leaks["start"], leaks["end"]):
        assert set(snap["pools"]) == {"prefill", "decode"} and snap["gateway_rss_bytes"] > 0
        assert {"rss_bytes", "num_keys", "num_bytes", "num_prefix_keys"} <= set(snap["stores"])
    # after the drain the restarted workers are back and nothing is held
    assert leaks["end"]["healthy"], leaks["end"]
    assert leaks["end"]["stores"]["num_keys"] == leaks["end"]["stores"]["num_prefix_keys"]
    assert all(
        pool["kv_blocks_in_use"] == pool["num_reserved"] == 0 for pool in leaks["end"]["pools"].values()
    )
    drift = report["latency_drift"]
    assert set(drift) == {"window_s", "first", "last"}
    assert set(drift["first"]) == {"num_requests", "ttft_p50_ms", "itl_p50_ms"}
