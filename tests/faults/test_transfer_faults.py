"""Faults on the state's way from prefill to decode, in a real deployment: every Nth store
operation fails, or a byte of KV or KDA state is flipped. Every request ends (its tokens, or a
clear 503), damage always fails closed and never where nothing was damaged, the gateway's
metrics count the failures, and afterwards nothing is held anywhere."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.launcher import ClusterHandle
from tests.e2e.helpers import assert_idle
from tests.faults.conftest import MODEL, TOKEN_IDS, FaultFile, fault_cluster, metric_value

NUM_CONCURRENT = 64
ROUTE = "/v1/completions"


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, fault_model: Path
) -> Iterator[tuple[ClusterHandle, FaultFile]]:
    faults = FaultFile(tmp_path_factory.mktemp("transfer-faults") / "faults.json")
    pool = {"kv_cache_memory_bytes": "64MiB", "max_num_seqs": NUM_CONCURRENT}
    with fault_cluster(faults.path, fault_model, prefill=pool, decode=pool) as cluster:
        yield cluster, faults


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(14)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(8, 96))] for _ in range(NUM_CONCURRENT)]


async def _send_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:  # a hang guard, not a latency bound
        return await asyncio.gather(*(http.post(ROUTE, json=body) for body in bodies))


def _body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **TOKEN_IDS, **extra}


def _tokens(response: httpx.Response) -> list[str]:
    return response.json()["choices"][0]["logprobs"]["tokens"]  # type: ignore[no-any-return]


def _errors_503(url: str) -> float:
    return metric_value(url, "splitserve_http_responses_total", route=ROUTE, status_code="503")


@pytest.fixture(scope="module")
def reference(served: tuple[ClusterHandle, FaultFile], prompts: list[list[int]]) -> list[list[str]]:
    """The 64 prompts' tokens with no fault armed: all succeed (no false positive under load)."""
    cluster, faults = served
    faults.disarm()
    responses = asyncio.run(_send_all(cluster.gateway_url or "", [_body(p) for p in prompts]))
    refused = [r.text for r in responses if r.status_code != 200]
    assert not refused, f"{len(refused)} refused with no fault armed, e.g. {refused[:2]}"
    assert not faults.hits()
    return [_tokens(r) for r in responses]


@pytest.mark.parametrize("kind", ["mla_kv", "kda_conv", "kda_recurrent"])
def test_a_flipped_byte_fails_closed_and_only_where_it_was_flipped(served, prompts, reference, kind):
    cluster, faults = served
    url = cluster.gateway_url or ""
    before = _errors_503(url)
    faults.arm(flip_every=5, flip_kind=kind, key_prefix="decode")
    responses = asyncio.run(_send_all(url, [_body(p) for p in prompts]))
    faults.disarm()
    hits = faults_hits_of(faults, "flip")
    assert all(len(hit) == 3 and "/" in hit[2] for hit in hits), hits
    flipped = {hit[2].split("/", 1)[1] for hit in hits}
    assert flipped, f"no {kind} chunk was flipped"
    failed = {}
    for i, response in enumerate(responses):
        if response.status_code == 200:
            assert _tokens(response) == reference[i], f"request {i} succeeded with other tokens"
            continue
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        # whichever side meets the damage first ends the request: the decode's reader (DATA_LOSS),
        # or the prefill, whose next write finds the key the decode dropped on seeing it
        assert ("DATA_LOSS" in message and "corrupt" in message) or "was released" in message, message
        failed[i] = message
    # every flipped request failed, and nothing else did (the message names its request id)
    assert len(failed) == len(flipped), (sorted(flipped), failed)
    assert all(any(rid in message for rid in flipped) for message in failed.values()), failed
    assert _errors_503(url) - before == len(failed)
    assert_idle(cluster, timeout_s=60)


def faults_hits_of(faults: FaultFile, what: str) -> list[list[str]]:
    return [hit for hit in faults.hits() if hit[0] == what]


def test_every_nth_store_operation_failing_ends_every_request_and_is_counted(served, prompts, reference):
    """A failed write of the handoff's state makes the prefill answer UNAVAILABLE: the gateway
    runs the prompt again (another prefill worker, else the decode worker itself), so the client
    gets the unbroken run's tokens; what cannot run again ends in a 503 naming the fault."""
    cluster, faults = served
    url = cluster.gateway_url or ""
    before, retries_before = _errors_503(url), _prefill_retries(url)
    faults.arm(fail_every=23, key_prefix="decode")
    bodies = [_body(p, stream=i % 2 == 1) for i, p in enumerate(prompts[:32])]
    responses = asyncio.run(_send_all(url, bodies))
    faults.disarm()
    failed_keys = {hit[1].split("/", 1)[1] for hit in faults_hits_of(faults, "fail")}
    failed_requests = {key.split("/", 1)[0] for key in failed_keys}
    assert failed_requests, "no store operation was failed"
    num_failed = 0
    for i, response in enumerate(responses):
        if response.status_code == 200:
            tokens = _tokens(response) if i % 2 == 0 else _streamed_tokens(response)
            assert tokens == reference[i], f"request {i} succeeded with other tokens"
            continue
        num_failed += 1
        assert response.status_code == 503, response.text
        message = response.json()["error"]["message"]
        assert "injected fault" in message and any(rid in message for rid in failed_requests), message
    num_retried = _prefill_retries(url) - retries_before
    # each request a failed operation touched ran again or ended in its 503, and nothing else did
    assert num_failed <= len(failed_requests) <= num_failed + num_retried <= 2 * len(failed_requests)
    assert _errors_503(url) - before == num_failed
    assert_idle(cluster, timeout_s=60)


def _prefill_retries(url: str) -> float:
    return metric_value(url, "splitserve_prefill_retries_total")


def _streamed_tokens(response: httpx.Response) -> list[str]:
    """The tokens of a completed SSE stream, in order."""
    tokens: list[str] = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[len("data: ") :])["choices"][0]
            tokens += (choice.get("logprobs") or {}).get("tokens") or []
    assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
    return tokens
