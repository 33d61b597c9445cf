"""A real deployment (1 prefill + 1 decode worker, prefix caching on, as by default) heals by itself
after a real SIGKILL of one of its processes under a bounded load of greedy streams, and says so:

* the store: requests fail while it is down, every one that starts once the controller restarted
  it succeeds, and nothing is held once the load stops;
* the only prefill worker: no request fails (the decode worker computes prompts meanwhile:
  `prefill.fallback: decode_local`), `/health` says `degraded` and still 200;
* the only decode worker: `/health` answers 503 until it is back, and every stream it was running
  waits for its restart and goes on with exactly the tokens of an uninterrupted run.

The kills are SIGKILLs of the processes the controller's status names; what is checked is read at
its source (the workers' own stats, the stores' Stats RPC: tests/e2e/helpers.py); tokens are
compared with the offline engine's."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from tests.e2e.helpers import assert_idle, worker_stats
from tests.faults.conftest import MODEL, metric_value, wait_for
from tests.faults.load import ClosedLoopLoad, Outcome, num_ok_since, random_prompts, summary

NUM_CLIENTS = 8
NUM_AFTER_HEALED = 24  # requests that must start and succeed once the deployment has healed
NUM_TOKENS = 24
PROMPTS = random_prompts(seed=5, count=32, min_len=16, max_len=96)


@pytest.fixture(scope="module")
def expected(fault_model: Path) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens from the offline engine (what the cluster gives unbroken)."""
    llm = LLM(model=str(fault_model), max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    results = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[params] * len(PROMPTS))
    return {tuple(p): r.outputs[0].token_ids for p, r in zip(PROMPTS, results)}


@pytest.fixture(scope="module")
def cluster(fault_model: Path) -> Iterator[ClusterHandle]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "64MiB", "max_num_seqs": 16}
    config = parse_config(
        {
            "model": {"path": str(fault_model), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": pool,
            "decode": pool,
            "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300, "max_restarts": 10},
        }
    )
    try:
        with run_cluster(config) as handle:
            yield handle
    finally:
        ray.shutdown()


def _body(client: int, n: int) -> dict[str, Any]:
    prompt = PROMPTS[(client * 7 + n) % len(PROMPTS)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}


def _wrong_tokens(outcomes: list[Outcome], expected: dict[tuple[int, ...], list[int]]) -> list[Outcome]:
    return [o for o in outcomes if o.ok and o.token_ids != expected[tuple(o.prompt)]]


def _health(cluster: ClusterHandle) -> tuple[int, dict[str, Any]]:
    response = httpx.get(f"{cluster.gateway_url}/health", timeout=30)
    return response.status_code, response.json()


def _worker_row(cluster: ClusterHandle, pool: str) -> dict[str, Any]:
    (row,) = cluster.status()["pools"][pool]["workers"]
    return row  # type: ignore[no-any-return]


def _worker_restarted(cluster: ClusterHandle, pool: str, before: dict[str, Any]) -> bool:
    row = _worker_row(cluster, pool)
    return bool(row["healthy"] and row["restarts"] > before["restarts"] and row["pid"] != before["pid"])


def _streams_running(cluster: ClusterHandle) -> bool:
    return bool(worker_stats(cluster, "decode", 0)["num_running"] >= 2)


def _store_row(cluster: ClusterHandle) -> dict[str, Any]:
    (row,) = cluster.status()["stores"]
    return row  # type: ignore[no-any-return]


def _restarted(cluster: ClusterHandle, before: dict[str, Any]) -> bool:
    row = _store_row(cluster)
    return bool(row["healthy"] and row["restarts"] > before["restarts"] and row["pid"] != before["pid"])


def _heals_after(load: ClosedLoopLoad, restarted_s: float) -> list[Outcome]:
    """Waits for the first success that started after `restarted_s`, then for NUM_AFTER_HEALED
    more requests to start and end; the outcomes of every request started since that success."""
    load.wait_for(lambda out: num_ok_since(out, restarted_s) > 0, "a request succeed after the restart")
    healed_s = min(o.started_s for o in load.outcomes if o.started_s >= restarted_s and o.ok)
    load.wait_for(
        lambda out: sum(1 for o in out if o.started_s >= healed_s) >= NUM_AFTER_HEALED,
        f"{NUM_AFTER_HEALED} requests after the deployment healed",
    )
    return [o for o in load.stop() if o.started_s >= healed_s]


def test_a_store_killed_under_load_heals_and_holds_nothing(cluster: ClusterHandle) -> None:
    """Before the fix, every reservation whose state reader could not reach the dead store kept
    its decode slot: once the store was back every request got 429 "every decode worker is full"
    for good, and the decode worker showed no free slot with nothing running."""
    load = ClosedLoopLoad(cluster.gateway_url or "", _body, NUM_CLIENTS)
    try:
        load.wait_for(lambda out: num_ok_since(out, 0) >= NUM_CLIENTS, "the load running")
        before = _store_row(cluster)
        os.kill(before["pid"], signal.SIGKILL)
        wait_for(lambda: _restarted(cluster, before), "the store restarted")
        after_healed = _heals_after(load, time.monotonic())
    finally:
        outcomes = load.stop()
    failed = [o for o in after_healed if not o.ok]
    assert not failed, f"requests failed after the deployment healed: {summary(failed)}; all: {summary(outcomes)}"
    assert_idle(cluster, timeout_s=60)


def test_the_only_prefill_worker_killed_under_load_loses_no_request(cluster: ClusterHandle, expected) -> None:
    url = cluster.gateway_url or ""
    load = ClosedLoopLoad(url, _body, NUM_CLIENTS)
    degraded: list[dict[str, Any]] = []
    try:
        load.wait_for(lambda out: num_ok_since(out, 0) >= NUM_CLIENTS, "the load running")
        before = _worker_row(cluster, "prefill")
        os.kill(before["pid"], signal.SIGKILL)

        def restarted_and_seen_degraded() -> bool:
            status, body = _health(cluster)
            assert status == 200, body  # the decode worker still serves every request
            if body["status"] == "degraded":
                degraded.append(body)
            return bool(degraded) and _worker_restarted(cluster, "prefill", before)

        wait_for(restarted_and_seen_degraded, "/health degraded, then the prefill worker restarted")
        wait_for(lambda: _health(cluster)[1]["status"] == "ok", "/health ok again")
        healed_s = time.monotonic()
        load.wait_for(lambda out: num_ok_since(out, healed_s) >= NUM_CLIENTS, "requests after it")
    finally:
        outcomes = load.stop()
    assert all(o.ok for o in outcomes), summary(outcomes)
    assert not _wrong_tokens(outcomes, expected)
    assert any("no prefill worker can take a prompt" in line for line in degraded[0]["problems"]), degraded
    assert metric_value(url, "splitserve_prefill_fallbacks_total", policy="decode_local") > 0
    assert_idle(cluster, timeout_s=60)


def test_the_only_decode_worker_killed_under_load_loses_no_stream(cluster: ClusterHandle, expected) -> None:
    """Its streams wait for the restart (decode.failover_wait_s) and re-prefill there exactly;
    /health is 503 while no decode worker can take a request."""
    url = cluster.gateway_url or ""
    load = ClosedLoopLoad(url, _body, NUM_CLIENTS)
    unavailable: list[dict[str, Any]] = []
    try:
        load.wait_for(lambda out: num_ok_since(out, 0) >= NUM_CLIENTS, "the load running")
        wait_for(lambda: _streams_running(cluster), "streams running on the decode worker")
        before = _worker_row(cluster, "decode")
        resumed = metric_value(url, "splitserve_decode_failovers_total", outcome="resumed")
        os.kill(before["pid"], signal.SIGKILL)
        killed_s = time.monotonic()

        def restarted_and_seen_unavailable() -> bool:
            status, body = _health(cluster)
            if status == 503:
                unavailable.append(body)
            return bool(unavailable) and _worker_restarted(cluster, "decode", before)

        wait_for(restarted_and_seen_unavailable, "/health 503, then the decode worker restarted")
        healed_s = time.monotonic()
        load.wait_for(lambda out: num_ok_since(out, healed_s) >= NUM_CLIENTS, "requests after it")
    finally:
        outcomes = load.stop()
    lost = [o for o in outcomes if not o.ok and o.started_s < killed_s]
    assert not lost, f"streams running at the kill were lost: {summary(lost)}"
    assert not _wrong_tokens(outcomes, expected)
    assert metric_value(url, "splitserve_decode_failovers_total", outcome="resumed") > resumed
    assert unavailable[0]["status"] == "degraded" and unavailable[0]["decode_workers"] == 0, unavailable[0]
    assert_idle(cluster, timeout_s=60)
