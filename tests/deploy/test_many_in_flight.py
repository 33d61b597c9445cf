"""Many requests in flight at once against one real deployment (local Ray, gRPC, HTTP): 100
concurrent greedy streams, three times the decode pool's slots, sent the moment the deployment is
up. Every one is answered 200 (the surplus waits in the gateway's admission queue, none is
refused), every stream's tokens equal the offline engine's for its prompt, and afterwards no
worker holds a request, reservation, block or slot and no store holds a request key.

The scaled-up run (100 / 250 / 500 in flight, with per-process threads, fds and RSS) is
`python -m experiments.many_in_flight`; docs/PERFORMANCE.md has its figures.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deploy.launcher import ClusterHandle, run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import MODEL, TOKEN_IDS, assert_idle, token_ids

NUM_REQUESTS = 100
DECODE_SLOTS = 32  # a third of the requests: the rest must queue, not be refused
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_tiny_model(tmp_path_factory.mktemp("many-in-flight-model"), seed=5)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(64, 256))] for _ in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def offline_tokens(model_path: Any, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=str(model_path), max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]


@pytest.fixture(scope="module")
def cluster(model_path: Any) -> Iterator[ClusterHandle]:
    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": DECODE_SLOTS}
    config = parse_config(
        {
            "model": {"path": str(model_path), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": pool,
            "decode": pool,
            "store": {"memory_bytes": "128MiB", "disk": {"path": None}},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
        }
    )
    with run_cluster(config, name="test-many-in-flight") as handle:
        yield handle


async def _stream(client: openai.AsyncOpenAI, prompt: list[int]) -> list[int] | str:
    """The stream's token ids, or what went wrong (status and message)."""
    tokens: list[int] = []
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            stream=True,
            extra_body=TOKEN_IDS,
        )
        async for event in stream:
            choice = event.choices[0]
            if choice.logprobs is not None:
                tokens += token_ids(choice)
    except openai.APIError as exc:
        return f"{getattr(exc, 'status_code', 'no status')}: {exc}"
    return tokens


async def _all_at_once(url: str, prompts: list[list[int]]) -> list[list[int] | str]:
    # the client's own pool allows 1,000 connections: every stream gets its own
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        return await asyncio.gather(*(_stream(client, p) for p in prompts))


@pytest.fixture(scope="module")
def results(cluster: ClusterHandle, prompts: list[list[int]]) -> list[list[int] | str]:
    url = cluster.gateway_url
    assert url, "the deployment has no gateway"
    return asyncio.run(_all_at_once(url, prompts))


def _metric_lines(url: str, prefix: str) -> list[tuple[str, float]]:
    """Each exposition line of the gateway's /metrics starting with `prefix`: (line, value)."""
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return [(line, float(line.rsplit(" ", 1)[1])) for line in lines if line.startswith(prefix)]


def _refusals(url: str) -> dict[str, float]:
    return {
        line.split('reason="', 1)[1].split('"', 1)[0]: value
        for line, value in _metric_lines(url, "splitserve_admission_refusals_total{")
    }


def _num_waited_over_1ms(url: str) -> float:
    """Requests the admission queue held more than 1 ms (its wait histogram: count - le=0.001)."""
    (count,) = [v for _, v in _metric_lines(url, "splitserve_admission_queue_seconds_count")]
    (quick,) = [
        v
        for line, v in _metric_lines(url, "splitserve_admission_queue_seconds_bucket")
        if 'le="0.001"' in line
    ]
    return count - quick


def test_every_one_of_100_concurrent_streams_is_answered_in_full(results: list[list[int] | str]) -> None:
    failed = {i: r for i, r in enumerate(results) if isinstance(r, str)}
    assert not failed, f"{len(failed)} of {NUM_REQUESTS} streams failed: {dict(list(failed.items())[:5])}"
    short = {i: len(r) for i, r in enumerate(results) if len(r) != MAX_TOKENS}
    assert not short, f"streams with other than {MAX_TOKENS} tokens: {short}"


def test_the_surplus_queued_rather_than_being_refused(
    cluster: ClusterHandle, results: list[list[int] | str]
) -> None:
    url = cluster.gateway_url
    assert url
    refused = {reason: n for reason, n in _refusals(url).items() if n}
    assert not refused, f"the admission queue refused requests: {refused}"
    # three times the slots arrived at once: the surplus did wait in the queue
    assert _num_waited_over_1ms(url) >= NUM_REQUESTS - DECODE_SLOTS


def test_every_stream_equals_the_offline_engine(
    results: list[list[int] | str], offline_tokens: list[list[int]]
) -> None:
    mismatched = [i for i, (got, want) in enumerate(zip(results, offline_tokens)) if got != want]
    assert not mismatched, f"streams {mismatched[:10]} differ from the offline engine's tokens"


def test_afterwards_no_worker_or_store_holds_anything(
    cluster: ClusterHandle, results: list[list[int] | str]
) -> None:
    assert_idle(cluster, timeout_s=30)
