"""Waiting on the engine loop's snapshots (`EngineLoop.wait_until`) and the decode worker's hold
on publishes (`PrefillYield`): a publish never starts while a prompt waits for its step."""

from __future__ import annotations

import queue
import threading

import pytest

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig
from splitserve.sampling_params import SamplingParams
from splitserve.worker.prefix_store.prefill_yield import PrefillYield
from tests.engine.step_gate import FakeClock, StepGate

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
WAIT_S = 30.0
SHORT_S = 0.05  # a wait that must run out (its False is what is checked, not its duration)


@pytest.fixture
def loop(tiny_model_path):
    engine_loop = EngineLoop(LLMEngine(EngineConfig(model=str(tiny_model_path), max_model_len=256)))
    yield engine_loop
    engine_loop.stop()


def _waiting(snapshot) -> bool:
    return snapshot.num_waiting == 0


def test_wait_until_answers_at_once_for_the_current_snapshot(loop):
    assert loop.wait_until(_waiting, WAIT_S)
    assert not loop.wait_until(lambda snapshot: snapshot.num_waiting == 1, SHORT_S)


def test_wait_until_waits_for_the_prompts_step_to_end(loop):
    updates: queue.Queue = queue.Queue()
    loop.watch("a", updates.put)
    with StepGate(loop.engine) as gate:
        loop.call(lambda e: e.add_request("a", [5, 6, 7], PARAMS)).result(timeout=WAIT_S)
        assert gate.entered.wait(WAIT_S)
        assert not loop.wait_until(_waiting, SHORT_S)  # the prompt's step is blocked
        done = threading.Event()
        waiter = threading.Thread(target=lambda: loop.wait_until(_waiting, WAIT_S) and done.set())
        waiter.start()
        gate.release.set()
        waiter.join(WAIT_S)
        assert done.is_set()
    assert updates.get(timeout=WAIT_S).new_token_ids  # the first token came from that step


def test_wait_until_gives_up_once_the_loop_stops(loop):
    with StepGate(loop.engine) as gate:
        loop.call(lambda e: e.add_request("a", [5, 6, 7], PARAMS)).result(timeout=WAIT_S)
        assert gate.entered.wait(WAIT_S)
        answer: list[bool] = []
        waiter = threading.Thread(target=lambda: answer.append(loop.wait_until(_waiting, WAIT_S)))
        waiter.start()
        loop.stop(timeout_s=0)  # stopping: the step in progress then ends and the thread exits
        gate.release.set()
        waiter.join(WAIT_S)
    loop.stop()
    assert answer == [False]


def test_a_hold_first_lets_the_settle_time_pass_since_the_prefix_was_retained(loop):
    clock, slept = FakeClock(), []
    hold = PrefillYield(loop, settle_s=0.05, clock=clock, sleep=slept.append)
    assert hold(clock() - 0.01)  # retained 10 ms ago: 40 ms to go
    assert slept == [pytest.approx(0.04)]
    assert hold(clock() - 1.0) and len(slept) == 1  # long ago: no sleep at all


def test_a_hold_returns_only_after_the_prompt_waiting_for_its_step_was_computed(loop):
    clock = FakeClock()
    hold = PrefillYield(loop, settle_s=0.0, clock=clock)
    with StepGate(loop.engine) as gate:
        loop.call(lambda e: e.add_request("a", [5, 6, 7], PARAMS)).result(timeout=WAIT_S)
        assert gate.entered.wait(WAIT_S)
        assert not PrefillYield(loop, settle_s=0.0, max_wait_s=SHORT_S, clock=clock)(clock())
        answer: list[bool] = []
        waiter = threading.Thread(target=lambda: answer.append(hold(clock())))
        waiter.start()
        assert not answer  # still held: the prompt's step has not run
        gate.release.set()
        waiter.join(WAIT_S)
    assert answer == [True]
