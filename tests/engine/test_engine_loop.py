"""The engine loop thread: commands run between steps, updates reach their watcher, stop is clean."""

from __future__ import annotations

import queue

import pytest

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig
from splitserve.sampling_params import SamplingParams


@pytest.fixture
def loop(tiny_model_path):
    engine_loop = EngineLoop(LLMEngine(EngineConfig(model=str(tiny_model_path), max_model_len=256)))
    yield engine_loop
    engine_loop.stop()
    assert not engine_loop._thread.is_alive()


def test_requests_from_another_thread_stream_their_tokens(loop):
    updates: queue.Queue = queue.Queue()
    loop.watch("a", updates.put)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    loop.call(lambda e: e.add_request("a", [5, 6, 7], params)).result(timeout=30)
    tokens = []
    while True:
        update = updates.get(timeout=30)
        tokens += update.new_token_ids
        if update.finished:
            break
    assert len(tokens) == 5
    assert update.request.finish_reason == "length"


def test_command_errors_reach_the_caller(loop):
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.call(lambda e: e.add_request("b", [], SamplingParams())).result(timeout=30)
    assert loop.alive


def test_calls_after_stop_fail_instead_of_hanging(loop):
    loop.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        loop.call(lambda e: None).result(timeout=5)
