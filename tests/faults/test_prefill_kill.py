"""A prefill worker SIGKILLed during the handshake (its requests reserved on the decode worker and
accepted, not yet started) or mid-transfer (the prompt computed, its state on the way to the
store): each of its requests is served anyway, by the decode worker computing the prompt itself
(`prefill.fallback: decode_local`, the default; the only prefill worker is gone), and nothing
leaks: the decode reservations the handoffs held and the store's entries are released, and once
the controller has restarted the worker the deployment serves as before. Real deployment; the
kill is a real SIGKILL of the worker's process."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.launcher import ClusterHandle
from tests.e2e.helpers import assert_idle, worker_stats
from tests.faults.conftest import MODEL, FaultFile, metric_value, slow_prefill_cluster, wait_for

ROUTE = "/v1/completions"
WAIT_S = 180.0  # a guard against a hang (a restart included), not a latency bound


@pytest.fixture(scope="module")
def served(fault_model: Path) -> Iterator[tuple[ClusterHandle, FaultFile]]:
    with slow_prefill_cluster(fault_model) as both:
        yield both


class Sent:
    """One request sent on its own thread; `wait` returns its response."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self._done = threading.Event()
        self.response: httpx.Response | None = None
        threading.Thread(target=self._send, args=(url, body), daemon=True).start()

    def _send(self, url: str, body: dict[str, Any]) -> None:
        try:
            self.response = httpx.post(f"{url}{ROUTE}", json=body, timeout=WAIT_S)
        finally:
            self._done.set()

    def wait(self) -> httpx.Response:
        assert self._done.wait(WAIT_S), "the request hung after its prefill worker died"
        assert self.response is not None, "the request failed in the client"
        return self.response


def _send(url: str, seed: int, num_tokens: int = 3000) -> Sent:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 2000) for _ in range(num_tokens)]
    return Sent(url, {"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": True})


def _prefill_row(cluster: ClusterHandle) -> dict[str, Any]:
    (row,) = cluster.status()["pools"]["prefill"]["workers"]
    return row  # type: ignore[no-any-return]


def _kill_prefill(cluster: ClusterHandle) -> int:
    """SIGKILLs the prefill worker's process; returns its restart count before."""
    row = _prefill_row(cluster)
    os.kill(row["pid"], signal.SIGKILL)
    return row["restarts"]  # type: ignore[no-any-return]


def _assert_served_elsewhere(response: httpx.Response) -> None:
    """Served whole although its prefill worker died: by the decode worker (decode_local)."""
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length", response.text


def _assert_recovered(cluster: ClusterHandle, restarts: int) -> None:
    """Nothing held anywhere once the worker is back, and a new request is served."""

    def restarted() -> bool:
        row = _prefill_row(cluster)
        return row["restarts"] > restarts and row["healthy"]

    wait_for(restarted, "the prefill worker restarted")
    assert_idle(cluster, timeout_s=60)
    response = _send(cluster.gateway_url or "", seed=99, num_tokens=16).wait()
    assert response.status_code == 200, response.text


def test_a_prefill_killed_during_the_handshake(served: tuple[ClusterHandle, FaultFile]) -> None:
    cluster, _ = served
    url = cluster.gateway_url or ""
    ahead = _send(url, seed=1)
    wait_for(lambda: worker_stats(cluster, "prefill", 0)["num_running"] == 1, "the first prompt prefilling")
    accepted = _send(url, seed=2)
    wait_for(lambda: worker_stats(cluster, "prefill", 0)["num_waiting"] == 1, "the second prompt accepted")
    assert worker_stats(cluster, "decode", 0)["num_reserved"] == 2
    fallbacks = metric_value(url, "splitserve_prefill_fallbacks_total", policy="decode_local")
    restarts = _kill_prefill(cluster)
    _assert_served_elsewhere(accepted.wait())
    _assert_served_elsewhere(ahead.wait())
    assert metric_value(url, "splitserve_prefill_fallbacks_total", policy="decode_local") >= fallbacks + 2
    _assert_recovered(cluster, restarts)


def test_a_prefill_killed_mid_transfer(served: tuple[ClusterHandle, FaultFile]) -> None:
    cluster, faults = served
    faults.arm(hold_puts=True, key_prefix="decode")  # the state stalls on its way to the store
    try:
        sent = _send(cluster.gateway_url or "", seed=3, num_tokens=200)
        wait_for(lambda: any(hit[0] == "hold" for hit in faults.hits()), "the state on its way")
        assert worker_stats(cluster, "decode", 0)["num_reserved"] == 1
        restarts = _kill_prefill(cluster)
        _assert_served_elsewhere(sent.wait())
    finally:
        faults.disarm()
    _assert_recovered(cluster, restarts)
