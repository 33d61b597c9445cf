"""A client that hangs up in each phase of its request (queued on the prefill worker, prefilling,
its state transferring, decoding) leaves every pool and store as it found them: all KV blocks
and state slots free, no reservation, no stored key or byte. Real deployment, raw sockets."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.launcher import ClusterHandle
from tests.e2e.helpers import assert_idle, worker_stats
from tests.faults.conftest import MODEL, FaultFile, RawRequest, slow_prefill_cluster, wait_for

ROUTE = "/v1/completions"
LONG_PROMPT_TOKENS = 3000


@pytest.fixture(scope="module")
def served(fault_model: Path) -> Iterator[tuple[ClusterHandle, FaultFile]]:
    with slow_prefill_cluster(fault_model) as both:
        yield both


@pytest.fixture(scope="module")
def cluster(served: tuple[ClusterHandle, FaultFile]) -> ClusterHandle:
    return served[0]


def _long_request(url: str, seed: int, **extra: Any) -> RawRequest:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 2000) for _ in range(LONG_PROMPT_TOKENS)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True, **extra}
    return RawRequest(url, ROUTE, body)


def _stats(cluster: ClusterHandle, pool: str) -> dict[str, Any]:
    return worker_stats(cluster, pool, 0)


def test_hanging_up_while_queued_on_the_prefill_worker(cluster: ClusterHandle) -> None:
    url = cluster.gateway_url or ""
    ahead = _long_request(url, seed=1)
    wait_for(lambda: _stats(cluster, "prefill")["num_running"] == 1, "the first prompt prefilling")
    queued = _long_request(url, seed=2)
    wait_for(lambda: _stats(cluster, "prefill")["num_waiting"] == 1, "the second prompt queued")
    assert _stats(cluster, "decode")["num_reserved"] == 2  # both hold decode room
    queued.cut()
    wait_for(lambda: _stats(cluster, "decode")["num_reserved"] == 1, "the queued one's room freed")
    assert _stats(cluster, "prefill")["num_waiting"] == 0
    ahead.cut()
    assert_idle(cluster, timeout_s=60)


def test_hanging_up_while_prefilling(cluster: ClusterHandle) -> None:
    request = _long_request(cluster.gateway_url or "", seed=3)
    wait_for(lambda: _stats(cluster, "prefill")["num_running"] == 1, "the prompt prefilling")
    request.cut()
    assert_idle(cluster, timeout_s=60)


def test_hanging_up_while_the_state_is_transferring(served: tuple[ClusterHandle, FaultFile]) -> None:
    """The store holds every put (a stalled transfer): the prompt is computed, its state on its way."""
    cluster, faults = served
    faults.arm(hold_puts=True)
    try:
        request = _long_request(cluster.gateway_url or "", seed=4, stream=True)
        wait_for(lambda: any(hit[0] == "hold" for hit in faults.hits()), "the request's state on its way")
        assert _stats(cluster, "decode")["num_reserved"] == 1
        request.cut()
        wait_for(lambda: _stats(cluster, "decode")["num_reserved"] == 0, "the reservation freed")
    finally:
        faults.disarm()  # the held put goes on, and finds its key released
    assert_idle(cluster, timeout_s=60)


def test_hanging_up_while_decoding(cluster: ClusterHandle) -> None:
    prompt = list(range(3, 40))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    request = RawRequest(cluster.gateway_url or "", ROUTE, body)
    request.read_until(b"data: ", count=3)  # the first token and two decoded ones
    running = _stats(cluster, "decode")["num_running"]
    assert running == 1, request.received[-600:]
    request.cut()
    assert_idle(cluster, timeout_s=60)
