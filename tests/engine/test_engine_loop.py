"""The engine loop thread: commands run between steps, updates reach their watcher, stop is clean."""

from __future__ import annotations

import queue

import pytest

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig
from splitserve.sampling_params import SamplingParams
from tests.engine.step_gate import FakeClock, StepGate


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


PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def clocked_loop(tiny_model_path):
    clock = FakeClock()
    engine_loop = EngineLoop(
        LLMEngine(EngineConfig(model=str(tiny_model_path), max_model_len=256)), clock=clock
    )
    yield engine_loop, clock
    engine_loop.stop()


def test_the_snapshot_answers_while_a_step_is_blocked_and_its_age_is_the_steps(clocked_loop):
    loop, clock = clocked_loop
    assert loop.snapshot().num_held_requests == 0 and loop.snapshot_age_s() == 0.0
    updates: queue.Queue = queue.Queue()
    loop.watch("slow", updates.put)
    with StepGate(loop.engine) as gate:
        loop.call(lambda e: e.add_request("slow", [5, 6, 7], PARAMS)).result(timeout=30)
        assert gate.entered.wait(30)
        # The step is blocked: a call would wait for it, the snapshot does not.
        blocked = loop.call(lambda e: e.scheduler.num_seqs)
        clock.advance(1000.0)
        snap = loop.snapshot()
        assert snap.num_waiting == 1 and snap.num_running == 0  # as the add left it
        assert loop.snapshot_age_s() == pytest.approx(1000.0)  # the step in progress has run that long
        assert not blocked.done()
        gate.release.set()
        assert blocked.result(timeout=30) == 1
    while not updates.get(timeout=30).finished:
        pass
    loop.call(lambda e: None).result(timeout=30)  # a pass after the one that finished it
    assert loop.snapshot().num_held_requests == 0 and loop.snapshot_age_s() == 0.0


def test_a_calls_effect_is_in_the_snapshot_once_the_call_resolves(clocked_loop):
    loop, _ = clocked_loop
    with StepGate(loop.engine) as gate:  # the request stays waiting until the gate opens
        loop.call(lambda e: e.add_request("seen", [5, 6, 7], PARAMS)).result(timeout=30)
        assert loop.snapshot().num_waiting == 1
        assert gate.entered.wait(30)


def test_the_snapshot_fails_once_the_engine_thread_died(clocked_loop):
    loop, _ = clocked_loop

    def broken_step() -> list:
        raise RuntimeError("device lost")

    loop.engine.step = broken_step
    loop.call(lambda e: e.add_request("doomed", [5, 6, 7], PARAMS)).result(timeout=30)
    loop._thread.join(30)
    assert not loop.alive
    with pytest.raises(RuntimeError, match="device lost"):
        loop.snapshot()


def test_an_observer_runs_after_each_pass_and_one_that_raises_is_dropped(clocked_loop):
    loop, _ = clocked_loop
    seen: queue.Queue = queue.Queue()

    def broken(engine: LLMEngine) -> None:
        raise ValueError("observer bug")

    loop.observe(lambda e: seen.put(e.scheduler.num_seqs)).result(timeout=30)
    loop.observe(broken).result(timeout=30)
    loop.call(lambda e: e.add_request("watched", [5, 6, 7], PARAMS)).result(timeout=30)
    assert seen.get(timeout=30) == 0  # ran once its own registration's pass ended
    assert loop.call(lambda e: broken in loop._observers).result(timeout=30) is False
    assert loop.alive
