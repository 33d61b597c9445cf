"""Delta imports: a stored prefix that extends the engine's own hit carries only the rows past it
(`ImportedPrefix.token_start`). Outputs equal caching off (greedy and seeded); a delta whose local
base was evicted before the request was scheduled is dropped whole and the request computes."""

from __future__ import annotations

import pytest

from splitserve import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.prefix_cache import ImportedPrefix, RetainedPrefix
from splitserve.state import StateKind
from tests.engine.test_prefix_cache import PARAMS, SHARED, _cached, _engine

FIRST = SHARED + [70, 71, 72]  # 153 tokens: its prompt end is 9 tokens into a block


@pytest.fixture(scope="module")
def reference(tiny_model_path) -> LLMEngine:
    return _engine(tiny_model_path)


def run(
    engine: LLMEngine, prompt: list[int], params: SamplingParams, **kwargs: object
) -> tuple[list[int], int]:
    request = engine.add_request(f"r{len(engine.requests)}-{id(prompt)}", prompt, params, **kwargs)
    while engine.has_unfinished_requests:
        engine.step()
    return list(request.output_token_ids), request.num_cached_tokens


def turn_end(path, params: SamplingParams) -> tuple[list[int], RetainedPrefix]:
    """Another engine serves FIRST: its reply and the retained state of prompt + reply (the end
    the next turn re-sends), as a store would hold it."""
    source = _cached(path)
    retained: list[RetainedPrefix] = []
    source.set_retention_listener(retained.append)
    reply, _ = run(source, FIRST, params)
    end = max(retained, key=lambda r: r.num_tokens)
    assert end.num_tokens == len(FIRST) + len(reply) - 1  # the last sampled token is never computed
    return reply, end


def whole(end: RetainedPrefix) -> ImportedPrefix:
    return ImportedPrefix(end.num_tokens, end.hash_chain, end.states)


@pytest.mark.parametrize("kind", sorted(PARAMS))
@pytest.mark.parametrize("token_start", [0, 128, len(FIRST)])  # whole, before the local hit, at it
def test_delta_extends_the_local_hit(tiny_model_path, reference, kind, token_start):
    params = PARAMS[kind]
    reply, end = turn_end(tiny_model_path, params)
    target = _cached(tiny_model_path)
    run(target, FIRST, SamplingParams(max_tokens=1))  # keeps FIRST's prompt end: a local hit of 153
    delta = whole(end).delta_from(token_start)
    assert all(s.token_start >= token_start for s in delta.states if s.kind is StateKind.MLA_KV)
    assert token_start == 0 or delta.num_bytes < whole(end).num_bytes
    prompt = FIRST + reply + [80, 81, 82]
    out, cached = run(target, prompt, params, imported_prefix=delta)
    assert cached == end.num_tokens
    assert out == run(reference, prompt, params)[0]
    stats = target.prefix_cache_stats()
    assert (stats.num_imported_tokens, stats.num_hit_tokens) == (end.num_tokens - len(FIRST), len(FIRST))
    # kept as if computed here: the next request hits the imported end locally
    again = FIRST + reply + [90]
    out, cached = run(target, again, params)
    assert cached == end.num_tokens and out == run(reference, again, params)[0]
    assert target.scheduler.blocks.num_free_blocks == target.plan.num_blocks


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_delta_without_its_local_base_is_dropped_and_computed(tiny_model_path, reference, kind):
    params = PARAMS[kind]
    reply, end = turn_end(tiny_model_path, params)
    target = _cached(tiny_model_path)
    cache = target.prefix_cache
    assert cache is not None
    run(target, FIRST, SamplingParams(max_tokens=1))  # keeps FIRST's prompt end: a local hit of 153
    delta = whole(end).delta_from(len(FIRST))  # fetched while the local hit was 153 tokens
    prompt = FIRST + reply + [80, 81, 82]
    request = target.add_request("next", prompt, params, imported_prefix=delta)
    for key in list(cache._snaps):  # noqa: SLF001 - the base is evicted before the request is scheduled
        cache.snapshots.evict(key)
    while target.has_unfinished_requests:
        target.step()
    assert request.num_cached_tokens == 0  # no partial state: neither the delta nor a stale base
    assert target.prefix_cache_stats().num_imported_tokens == 0
    assert list(request.output_token_ids) == run(reference, prompt, params)[0]


def test_delta_pieces_outside_its_range_are_refused(tiny_model_path):
    reply, end = turn_end(tiny_model_path, PARAMS["greedy"])
    engine = _cached(tiny_model_path)
    prompt = FIRST + reply + [1, 2]
    full = whole(end)
    with pytest.raises(ValueError, match="outside its rows"):  # rows before token_start
        engine.add_request(
            "a",
            prompt,
            PARAMS["greedy"],
            imported_prefix=ImportedPrefix(
                full.num_tokens, full.hash_chain, full.states, token_start=len(FIRST)
            ),
        )
    with pytest.raises(ValueError, match="incomplete"):  # a delta missing rows
        short = full.delta_from(len(FIRST))
        mla = [s for s in short.states if s.kind is StateKind.MLA_KV]
        engine.add_request(
            "b",
            prompt,
            PARAMS["greedy"],
            imported_prefix=ImportedPrefix(
                short.num_tokens, short.hash_chain, [s for s in short.states if s is not mla[0]], len(FIRST)
            ),
        )
    with pytest.raises(ValueError, match="must start inside"):
        full.delta_from(full.num_tokens)
