"""`Prefill.CacheReport`'s worker side: the engine's prefix events after each reader's cursor (a
snapshot for a reader without one), and its counters."""

from __future__ import annotations

import functools

from splitserve import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.prefix_cache.events import PrefixEvent
from splitserve.engine_config import EngineConfig
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.v1 import prefill_pb2
from splitserve.worker.cache_report import CacheReporter
from tests.prefix.queued_events import QueuedPrefixEvents

UNIT = 32


def _run(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    """Prompt and output tokens of one request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    request = engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests:
        engine.step()
    return prompt + list(request.output_token_ids)


def _cursor(report: prefill_pb2.PrefixCacheReport) -> prefill_pb2.CacheReportRequest:
    return prefill_pb2.CacheReportRequest(instance_id=report.instance_id, after_seq=report.last_seq)


def test_a_report_carries_the_events_after_the_cursor_and_the_counters(model_path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_path), max_model_len=1024, block_size=16, prefix_unit=UNIT,
            enable_prefix_caching=True,
        )
    )  # fmt: skip
    reporter = CacheReporter()
    start = reporter.take(engine)  # a reader's first report: a snapshot (nothing usable yet)
    assert start.snapshot and list(start.events) == []
    prompt = [5 + (i * 7) % 300 for i in range(100)]
    first = _run(engine, "a", prompt)
    second = _run(engine, "b", prompt + [9, 9, 9, 9])  # the next turn: hits the first prompt's end
    report = reporter.take(engine, _cursor(start))
    assert not report.snapshot
    stored = [e for e in report.events if e.stored]
    assert stored, "a retained prompt end is announced"
    # Named by the chain (the engine's own, salt b"") of the tokens either request ran.
    names = set(prefix_hash_chain(first, UNIT)) | set(prefix_hash_chain(second, UNIT))
    assert {e.block_hash for e in report.events} <= names
    assert all(UNIT <= e.num_tokens <= len(second) for e in report.events)
    assert report.last_seq == start.last_seq + len(report.events)
    assert report.num_queried_tokens == len(prompt) + len(prompt) + 4
    assert report.num_hit_tokens > 0 and report.num_imported_tokens == 0
    assert report.num_snapshots >= 1 and report.snapshot_bytes > 0
    again = reporter.take(engine, _cursor(report))
    assert list(again.events) == [] and not again.snapshot  # nothing new after the cursor
    assert again.instance_id == report.instance_id != CacheReporter().instance_id
    assert again.num_hit_tokens == report.num_hit_tokens


def _usable(report: prefill_pb2.PrefixCacheReport) -> dict[bytes, int]:
    assert report.snapshot and all(e.stored for e in report.events)
    return {e.block_hash: e.num_tokens for e in report.events}


def test_two_readers_each_see_every_event_and_a_late_one_gets_a_snapshot() -> None:
    engine, reporter = QueuedPrefixEvents(), CacheReporter(max_logged_events=4)
    report = functools.partial(reporter.take, engine)  # type: ignore[arg-type]
    start = _cursor(report())
    engine.pending = [PrefixEvent("stored", b"a", 64), PrefixEvent("stored", b"b", 128)]
    one = report(start)
    other = report(start)  # the second gateway: the same events, not drained
    assert [e.block_hash for e in one.events] == [e.block_hash for e in other.events] == [b"a", b"b"]
    engine.pending = [PrefixEvent("removed", b"a", 64)]
    following = report(_cursor(one))
    assert [(e.stored, e.block_hash) for e in following.events] == [(False, b"a")]
    # Past the log's reach (it keeps 4 events; 6 came after that cursor): a snapshot of the
    # units usable now, which the reader puts in place of what it believed.
    engine.pending = [PrefixEvent("stored", name, 64) for name in (b"c", b"d", b"e")]
    assert _usable(report(start)) == {b"b": 128, b"c": 64, b"d": 64, b"e": 64}
    # Another engine instance's cursor (the worker restarted under the same address): a snapshot too.
    stranger = prefill_pb2.CacheReportRequest(instance_id="old", after_seq=following.last_seq)
    assert _usable(report(stranger)) == {b"b": 128, b"c": 64, b"d": 64, b"e": 64}
    assert not report(_cursor(following)).snapshot  # 3 behind: in reach
