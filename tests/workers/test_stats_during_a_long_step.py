"""Load reports answer from the engine's last snapshot while a step runs; a stuck one still shows.

Each worker's engine is held inside one step by a gate the test controls (a long prompt's
prefill chunk, without waiting for one): the controller's `stats()`, `Decode.Stats` and
`Prefill.CacheReport` answer anyway, and the controller's health probe passes a step that has
run long but fails one that has run past its stuck limit (the loop's clock is a fake the test
moves), naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from colocated_worker.actor import ColocatedWorkerActor
from decode_worker.actor import DecodeWorkerActor
from deploy.health import STUCK_AFTER_TIMEOUTS, HealthWatcher
from deploy.members import Member
from prefill_worker.actor import PrefillWorkerActor
from splitserve.config import HealthConfig
from splitserve.rpc import make_channel
from splitserve.sampling_params import SamplingParams
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from splitserve.worker.actor_base import WorkerActorBase
from tests.engine.step_gate import FakeClock, StepGate

PROMPT = list(range(5, 45))
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
RPC_TIMEOUT_S = 20.0  # far longer than an answer takes; the step stays blocked throughout
HEALTH = HealthConfig(timeout_s=10)


@pytest.fixture(scope="module")
def workers(engine_config, store_server) -> Iterator[dict[str, WorkerActorBase]]:
    _, store_address = store_server
    started: dict[str, WorkerActorBase] = {
        "prefill": PrefillWorkerActor(engine_config, store_address),
        "decode": DecodeWorkerActor(engine_config, store_address),
        "colocated": ColocatedWorkerActor(engine_config),
    }
    for worker in started.values():
        worker.start("127.0.0.1", 0)
    yield started
    for worker in started.values():
        worker.shutdown()


class _Blocked:
    """A worker whose engine is inside a step the test holds, with a request in it."""

    def __init__(self, worker: WorkerActorBase, request_id: str) -> None:
        self.worker, self.clock = worker, FakeClock()
        self.gate = StepGate(worker.loop.engine)
        self._request_id = request_id

    def __enter__(self) -> _Blocked:
        self.worker.loop.clock = self.clock  # idle now: no age has been measured with the old one
        self.gate.__enter__()
        rid = self._request_id
        self.worker.loop.call(lambda e: e.add_request(rid, PROMPT, PARAMS)).result(timeout=30)
        assert self.gate.entered.wait(30), "the engine never started the step"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.gate.__exit__(*exc)
        rid = self._request_id
        self.worker.loop.call(lambda e: e.abort_request(rid)).result(timeout=30)


class _InProcessHandle:
    """What the health watcher calls (`handle.health.remote()`), on an actor in this process."""

    def __init__(self, worker: WorkerActorBase) -> None:
        self.health, self.stats = _Method(worker.health), _Method(worker.stats)


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self) -> Any:
        async def answer() -> Any:
            return self._fn()

        return answer()


class _Starter:
    def __init__(self) -> None:
        self.killed: list[Member] = []

    def kill(self, member: Member) -> None:
        self.killed.append(member)

    async def start_again(self, member: Member) -> None:
        pass  # the test looks at the verdict only


class _Roster:
    def __init__(self, member: Member) -> None:
        self._members = [member]
        self.stores: dict[str, Member] = {}  # no node stores: none to drop

    def members(self) -> list[Member]:
        return list(self._members)


class _Publisher:
    async def publish(self, *, force: bool = False) -> None:
        pass


def _probe(worker: WorkerActorBase) -> tuple[Member, _Starter]:
    """One health pass over `worker` as the controller runs it; the member and who was killed."""
    member = Member(kind=worker.role, index=0, handle=_InProcessHandle(worker), healthy=True)
    starter = _Starter()
    watcher = HealthWatcher(HEALTH, _Roster(member), starter, _Publisher())  # type: ignore[arg-type]
    asyncio.run(watcher.check_once())
    return member, starter


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_stats_answer_while_the_step_is_blocked(workers, role):
    worker = workers[role]
    with _Blocked(worker, f"stats-{role}") as blocked:
        blocked.clock.advance(42.0)
        stats = worker.stats()
        assert stats["num_waiting"] == 1  # the add's pass published it; the step has not ended
        assert stats["stats_age_s"] == 42.0  # how long the step in progress has run
        assert not blocked.gate.release.is_set()
    assert worker.stats()["stats_age_s"] == 0.0  # idle again after the abort: current


@pytest.mark.parametrize("role", ["decode", "colocated"])
def test_decode_stats_answer_while_the_step_is_blocked(workers, role):
    worker = workers[role]
    with _Blocked(worker, f"decode-stats-{role}"), make_channel(worker.address) as channel:
        room = decode_pb2_grpc.DecodeStub(channel).Stats(decode_pb2.DecodeStatsRequest(), timeout=RPC_TIMEOUT_S)
        assert room.max_num_seqs == worker.engine_config.max_num_seqs
        assert 0 < room.num_free_kv_blocks <= room.num_total_kv_blocks


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_cache_report_answers_while_the_step_is_blocked(workers, role):
    worker = workers[role]
    with _Blocked(worker, f"cache-report-{role}"), make_channel(worker.address) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        first = stub.CacheReport(prefill_pb2.CacheReportRequest(), timeout=RPC_TIMEOUT_S)
        again = stub.CacheReport(prefill_pb2.CacheReportRequest(), timeout=RPC_TIMEOUT_S)
        assert first.instance_id == again.instance_id != ""


def test_a_long_step_passes_the_health_probe(workers):
    worker = workers["prefill"]
    with _Blocked(worker, "long-step") as blocked:
        blocked.clock.advance(STUCK_AFTER_TIMEOUTS * HEALTH.timeout_s - 1)  # longer than any probe
        member, starter = _probe(worker)
        assert starter.killed == [] and member.error is None
        assert member.stats["stats_age_s"] == STUCK_AFTER_TIMEOUTS * HEALTH.timeout_s - 1


def test_a_stuck_engine_fails_the_health_probe_and_is_restarted(workers):
    worker = workers["decode"]
    with _Blocked(worker, "stuck-step") as blocked:
        blocked.clock.advance(STUCK_AFTER_TIMEOUTS * HEALTH.timeout_s + 1)
        member, starter = _probe(worker)
        assert starter.killed == [member] and member.restarts == 1
        assert member.error is not None and member.error.startswith("engine stuck")


def test_a_dead_engine_fails_the_health_probe(engine_config):
    worker = ColocatedWorkerActor(engine_config)
    worker.start("127.0.0.1", 0)
    try:

        def broken_step() -> list:
            raise RuntimeError("device lost")

        worker.loop.engine.step = broken_step
        worker.loop.call(lambda e: e.add_request("doomed", PROMPT, PARAMS)).result(timeout=30)
        worker.loop._thread.join(30)
        member, starter = _probe(worker)
        assert starter.killed == [member] and member.error == "health() returned False"
        with pytest.raises(RuntimeError, match="device lost"):
            worker.stats()  # no numbers from an engine that will never change them
    finally:
        worker.shutdown()
