"""A client that hangs up in each phase of its request (queued on the prefill worker, prefilling,
its state transferring, decoding) leaves every pool and store as it found them: all KV blocks
and state slots free, no reservation, no stored key or byte. Real deployment, raw sockets."""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy.launcher import ClusterHandle
from tests.e2e.helpers import assert_idle, worker_stats
from tests.faults.conftest import MODEL, FaultFile, RawRequest, fault_cluster

ROUTE = "/v1/completions"
LONG_PROMPT_TOKENS = 3000
WAIT_S = 120.0  # a guard against a hang, not a latency bound


@pytest.fixture(scope="module")
def served(fault_model: Path) -> Iterator[tuple[ClusterHandle, FaultFile]]:
    # An 8-token budget makes a long prompt's prefill take hundreds of steps, and one sequence at a
    # time keeps a second prompt queued behind it, so each phase lasts long enough to be caught.
    prefill = {"kv_cache_memory_bytes": "64MiB", "max_num_batched_tokens": 8, "max_num_seqs": 1}
    decode = {"kv_cache_memory_bytes": "64MiB"}
    with (
        tempfile.TemporaryDirectory(prefix="splitserve-faults-") as tmp,
        fault_cluster(Path(tmp) / "faults.json", fault_model, prefill=prefill, decode=decode) as handle,
    ):
        yield handle, FaultFile(Path(tmp) / "faults.json")


@pytest.fixture(scope="module")
def cluster(served: tuple[ClusterHandle, FaultFile]) -> ClusterHandle:
    return served[0]


def _long_request(url: str, seed: int, **extra: Any) -> RawRequest:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 2000) for _ in range(LONG_PROMPT_TOKENS)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True, **extra}
    return RawRequest(url, ROUTE, body)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.02)


def _stats(cluster: ClusterHandle, pool: str) -> dict[str, Any]:
    return worker_stats(cluster, pool, 0)


def test_hanging_up_while_queued_on_the_prefill_worker(cluster: ClusterHandle) -> None:
    url = cluster.gateway_url or ""
    ahead = _long_request(url, seed=1)
    _wait_for(lambda: _stats(cluster, "prefill")["num_running"] == 1, "the first prompt prefilling")
    queued = _long_request(url, seed=2)
    _wait_for(lambda: _stats(cluster, "prefill")["num_waiting"] == 1, "the second prompt queued")
    assert _stats(cluster, "decode")["num_reserved"] == 2  # both hold decode room
    queued.cut()
    _wait_for(lambda: _stats(cluster, "decode")["num_reserved"] == 1, "the queued one's room freed")
    assert _stats(cluster, "prefill")["num_waiting"] == 0
    ahead.cut()
    assert_idle(cluster, timeout_s=60)


def test_hanging_up_while_prefilling(cluster: ClusterHandle) -> None:
    request = _long_request(cluster.gateway_url or "", seed=3)
    _wait_for(lambda: _stats(cluster, "prefill")["num_running"] == 1, "the prompt prefilling")
    request.cut()
    assert_idle(cluster, timeout_s=60)


def test_hanging_up_while_the_state_is_transferring(served: tuple[ClusterHandle, FaultFile]) -> None:
    """The store holds every put (a stalled transfer): the prompt is computed, its state on its way."""
    cluster, faults = served
    faults.arm(hold_puts=True)
    try:
        request = _long_request(cluster.gateway_url or "", seed=4, stream=True)
        _wait_for(lambda: any(hit[0] == "hold" for hit in faults.hits()), "the request's state on its way")
        assert _stats(cluster, "decode")["num_reserved"] == 1
        request.cut()
        _wait_for(lambda: _stats(cluster, "decode")["num_reserved"] == 0, "the reservation freed")
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
