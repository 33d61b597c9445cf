"""A worker removed by a scale-down first finishes what it holds, up to its drain deadline."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_worker.actor import DecodeWorkerActor
from splitserve import LLM, SamplingParams
from tests.workers.client import generate, reserve

PROMPT = list(range(3, 60))
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def decode_worker(engine_config, store_server):
    worker = DecodeWorkerActor(engine_config, store_server[1])
    address = worker.start("127.0.0.1", 0)
    yield worker, address
    worker.shutdown()


def test_a_draining_decode_worker_finishes_a_request_it_had_reserved(cluster, decode_worker, engine_config):
    _, addr = cluster
    worker, address = decode_worker
    reserved = reserve(address, "drain-finishes", PROMPT)
    with ThreadPoolExecutor(1) as pool:
        shutdown = pool.submit(worker.shutdown, 60)
        # The reservation is held, so the drain must still be waiting: the whole request runs
        # against a worker whose shutdown has begun.
        result = generate(addr["prefill"], address, "drain-finishes", PROMPT, PARAMS, reserved=reserved)
        assert shutdown.result(timeout=60) == 0
    offline = LLM(model=engine_config.model, max_model_len=512).generate(
        prompt_token_ids=[PROMPT], sampling_params=PARAMS
    )
    assert result.token_ids == offline[0].outputs[0].token_ids
    assert result.finish_reason == "length"


def test_a_request_still_held_at_the_drain_deadline_is_counted_and_the_worker_stops(decode_worker):
    worker, address = decode_worker
    reserve(address, "never-prefilled", PROMPT)
    assert worker.shutdown(drain_timeout_s=0.2) == 1
    assert not worker.loop.alive
