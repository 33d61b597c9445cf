"""`Prefill.CacheReport`'s worker side: the engine's prefix events, drained once, and its counters."""

from __future__ import annotations

from splitserve import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.worker.cache_report import CacheReporter

UNIT = 32


def _run(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    """Prompt and output tokens of one request run alone."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    request = engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests:
        engine.step()
    return prompt + list(request.output_token_ids)


def test_a_report_drains_the_engines_events_and_carries_its_counters(model_path) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_path), max_model_len=1024, block_size=16, prefix_unit=UNIT,
            enable_prefix_caching=True,
        )
    )  # fmt: skip
    reporter = CacheReporter()
    prompt = [5 + (i * 7) % 300 for i in range(100)]
    first = _run(engine, "a", prompt)
    second = _run(engine, "b", prompt + [9, 9, 9, 9])  # the next turn: hits the first prompt's end
    report = reporter.take(engine)
    stored = [e for e in report.events if e.stored]
    assert stored, "a retained prompt end is announced"
    # Named by the chain (the engine's own, salt b"") of the tokens either request ran.
    names = set(prefix_hash_chain(first, UNIT)) | set(prefix_hash_chain(second, UNIT))
    assert {e.block_hash for e in report.events} <= names
    assert all(UNIT <= e.num_tokens <= len(second) for e in report.events)
    assert report.num_queried_tokens == len(prompt) + len(prompt) + 4
    assert report.num_hit_tokens > 0 and report.num_imported_tokens == 0
    assert report.num_snapshots >= 1 and report.snapshot_bytes > 0
    again = reporter.take(engine)
    assert list(again.events) == []  # drained: each event reaches the gateway once
    assert again.instance_id == report.instance_id != CacheReporter().instance_id
    assert again.num_hit_tokens == report.num_hit_tokens
