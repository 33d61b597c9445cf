"""Arriving state lands in the reserved room from the reader's thread, not between engine steps.

The decode engine here is stuck inside one deliberately slow step (a gate the test holds) while
every piece of a transferred prompt arrives: the reader must have it all in place before that
step ends, however many pieces there are. Then admission is one engine command, and the request
decodes on the next step with the offline engine's tokens.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator

import pytest

from decode_worker.state_reader import StateReader
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine, RequestUpdate
from splitserve.engine.state_codec import encode
from splitserve.engine.state_transfer import LayerState
from splitserve.sampling_params import SamplingParams
from splitserve.state import Chunk

PROMPT = list(range(5, 125))
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SLOW_STEP_S = 0.05  # the step is slow on purpose; nothing below waits on wall time


class FakeStream:
    """A Get stream the test feeds chunk by chunk (what `StateStoreClient.get` returns)."""

    def __init__(self) -> None:
        self.cancelled = False
        self._chunks: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()

    def push(self, chunk: Chunk | None) -> None:
        self._chunks.put(chunk)

    def __iter__(self) -> Iterator[Chunk]:
        while (chunk := self._chunks.get()) is not None:
            yield chunk

    def cancel(self) -> None:
        self.cancelled = True
        self._chunks.put(None)


class FakeStore:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    def get(self, key: str, *, timeout_s: float, wait_for_key: bool) -> FakeStream:
        return self.stream


class GatedSteps:
    """Wraps `engine.step`: counts steps, sleeps in each, and can hold the engine inside one."""

    def __init__(self, engine: LLMEngine) -> None:
        self.count = 0
        self.open = threading.Event()
        self.open.set()
        self.inside = threading.Event()
        self._step = engine.step
        engine.step = self  # type: ignore[method-assign]

    def __call__(self) -> list[RequestUpdate]:
        self.count += 1
        self.inside.set()
        self.open.wait()
        time.sleep(SLOW_STEP_S)
        return self._step()

    def hold(self) -> int:
        """Returns once the engine is inside a step it cannot leave; that step's number."""
        self.open.clear()
        self.inside.clear()
        assert self.inside.wait(60), "the engine never stepped"
        return self.count


def _exported_state(engine_config, max_num_batched_tokens: int) -> tuple[list[LayerState], int]:
    """The prompt's state as the prefill hands it over (one piece per chunk per MLA layer)."""
    prefill = LLMEngine(dataclasses.replace(engine_config, max_num_batched_tokens=max_num_batched_tokens))
    states: list[LayerState] = []
    request = prefill.add_request("p", PROMPT, PARAMS, export=states.append)
    while prefill.has_unfinished_requests:
        prefill.step()
    return states, request.output_token_ids[0]


@pytest.fixture(scope="module")
def offline_tokens(engine_config) -> list[int]:
    engine = LLMEngine(engine_config)
    request = engine.add_request("o", PROMPT, PARAMS)
    while engine.has_unfinished_requests:
        engine.step()
    return request.output_token_ids


@pytest.mark.parametrize("chunk_tokens", [512, 16])  # 1 piece per MLA layer, then 8
def test_every_piece_lands_inside_the_step_it_arrived_in(engine_config, offline_tokens, chunk_tokens):
    states, first_token = _exported_state(engine_config, chunk_tokens)
    assert len(states) >= (1 if chunk_tokens > len(PROMPT) else 8)
    engine = LLMEngine(engine_config)
    steps = GatedSteps(engine)
    loop = EngineLoop(engine, name="slow-decode")
    busy = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        loop.call(lambda e: e.add_request("busy", [3, 4, 5], busy)).result(30)
        sink = loop.call(lambda e: e.transfer_sink("r") if e.reserve_transfer("r", len(PROMPT)) else None)
        sink = sink.result(30)
        assert sink is not None
        stream = FakeStream()
        reader = StateReader(sink, FakeStore(stream), "r", "key", timeout_s=60)  # type: ignore[arg-type]
        held_step = steps.hold()
        for state in states:
            for chunk in encode(state, "key", max_chunk_bytes=4096):
                stream.push(chunk)
        stream.push(None)
        reader.wait(60)  # the engine is still inside step `held_step`: nobody else wrote the pieces
        assert steps.count == held_step
        assert sink.complete and reader.num_pieces >= len(states)
        steps.open.set()

        updates: queue.SimpleQueue[tuple[int, RequestUpdate]] = queue.SimpleQueue()
        loop.watch("r", lambda u: updates.put((steps.count, u)))
        admit = loop.call(lambda e: (e.admit_transferred("r", PROMPT, PARAMS, first_token), steps.count))
        request, admitted_in = admit.result(30)
        first_step, _ = updates.get(timeout=60)
        assert first_step == admitted_in + 1  # the very next step decodes it
        while not request.finished:
            updates.get(timeout=60)
        assert request.output_token_ids == offline_tokens
    finally:
        steps.open.set()
        loop.call(lambda e: e.abort_request("busy"))
        loop.stop()
