"""Queue time is measured inside the engine: arrival (or admission) to the first schedule."""

from __future__ import annotations

import time

import pytest

from splitserve.engine.llm_engine import LLMEngine, RequestUpdate
from splitserve.engine_config import EngineConfig
from splitserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def one_seq_engine(tiny_model_path):
    return LLMEngine(EngineConfig(model=str(tiny_model_path), max_num_seqs=1, max_model_len=256))


def _steps_until_done(engine: LLMEngine) -> list[tuple[RequestUpdate, float]]:
    """Every update with the monotonic time its step returned."""
    seen = []
    while engine.has_unfinished_requests:
        updates = engine.step()
        now = time.monotonic()
        seen.extend((update, now) for update in updates)
    return seen


def test_a_request_that_waits_for_a_seat_reports_the_wait(one_seq_engine):
    first = one_seq_engine.add_request("first", [5, 6, 7], PARAMS)
    second = one_seq_engine.add_request("second", [8, 9], PARAMS)
    seen = _steps_until_done(one_seq_engine)
    first_done_s = next(t for u, t in seen if u.request is first and u.finished)
    # max_num_seqs=1: the second is first scheduled in a step after the first one finished
    assert second.first_scheduled_s is not None and second.first_scheduled_s >= first_done_s
    assert first.queue_s is not None and second.queue_s is not None
    # it arrived before the first was scheduled, so it waited out the whole first run
    assert second.queue_s >= first_done_s - first.first_scheduled_s > 0
    assert first.queue_s >= 0


def test_only_the_first_update_carries_the_queue_time(one_seq_engine):
    request = one_seq_engine.add_request("once", [5, 6, 7], PARAMS)
    updates = [u for u, _ in _steps_until_done(one_seq_engine)]
    assert len(updates) == 3
    assert updates[0].queue_s == request.queue_s is not None
    assert [u.queue_s for u in updates[1:]] == [None, None]


def test_an_admitted_transfer_queues_from_its_admission(one_seq_engine):
    engine = one_seq_engine
    prompt = [5, 6, 7]
    states: list = []
    engine.add_request("source", prompt, PARAMS, export=states.append)  # its state, as a prefill exports it
    first_token_id = [u for u, _ in _steps_until_done(engine)][0].new_token_ids[0]
    assert engine.reserve_transfer("moved", len(prompt))
    reserved_at = time.monotonic()
    for state in states:
        engine.write_transferred_state("moved", state)
    engine.admit_transferred("moved", prompt, PARAMS, first_token_id=first_token_id)
    request = engine.scheduler.running[0]
    assert request.arrival_s >= reserved_at  # the wait for the state is not queue time
    updates = [u for u, _ in _steps_until_done(engine)]
    assert updates[0].queue_s is not None and updates[0].queue_s >= 0
    assert request.first_scheduled_s is not None and request.first_scheduled_s >= request.arrival_s
