"""A tensor-parallel engine's prefix cache meets the store's: the retention listener of a TP=2
engine hears each retained prefix whole (every MLA piece once, one KDA piece per rank naming its
heads), also when the caller ends a request, and a prefix retained at one width, imported at
another, gives the greedy tokens of an engine that computed it all."""

from __future__ import annotations

from collections import Counter

import pytest

from splitserve import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.prefix_cache import ImportedPrefix, RetainedPrefix
from splitserve.engine_config import EngineConfig
from splitserve.state import HeadRange, StateKind

UNIT = 16
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(path, size: int, caching: bool = True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_model_len=256,
            tensor_parallel_size=size,
            enable_prefix_caching=caching,
            prefix_unit=UNIT,
        )
    )


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests:
        engine.step()


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    """By name: "1" and "2" ranks, and "2'", another of 2 (an import from "2" is not a local hit)."""
    built = {name: _engine(tiny_model_path, int(name[0])) for name in ("1", "2", "2'")}
    yield built
    for engine in built.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """Caching off, one rank: the tokens every run must give."""
    engine = _engine(tiny_model_path, 1, caching=False)

    def run(prompt: list[int]) -> list[int]:
        request = engine.add_request(f"ref-{len(prompt)}-{prompt[0]}", prompt, PARAMS)
        _run(engine)
        return request.output_token_ids

    return run


def _retained(engine: LLMEngine, prompt: list[int], rid: str) -> tuple[list[RetainedPrefix], list[int]]:
    got: list[RetainedPrefix] = []
    engine.set_retention_listener(got.append)
    try:
        request = engine.add_request(rid, prompt, PARAMS)
        _run(engine)
    finally:
        engine.set_retention_listener(None)
    return got, request.output_token_ids


def _assert_every_rank_heads(engine: LLMEngine, prefix: RetainedPrefix) -> None:
    mc = engine.model_config
    mla = [s for s in prefix.states if s.kind is StateKind.MLA_KV]
    assert sorted(s.layer_id for s in mla) == sorted(mc.mla_layer_ids)
    assert all((s.token_start, s.token_end) == (0, prefix.num_tokens) for s in mla)
    kda = [s for s in prefix.states if s.kind is not StateKind.MLA_KV]
    half, num_heads = mc.linear_num_heads // 2, mc.linear_num_heads
    for (layer, kind), n in Counter((s.layer_id, s.kind) for s in kda).items():
        assert n == 2, (layer, kind)
    assert {s.heads for s in kda} == {HeadRange(0, half, num_heads), HeadRange(half, num_heads, num_heads)}
    assert len(kda) == 2 * 2 * len(mc.kda_layer_ids)


def test_a_tp_engine_hands_its_listener_every_ranks_heads_of_each_retained_prefix(engines, reference):
    prompt = list(range(20, 20 + 4 * UNIT + 5))
    got, tokens = _retained(engines["2"], prompt, "whole")
    assert tokens == reference(prompt)
    # the prompt's end and the finished request's end (prompt + every reply token but the last)
    assert [p.num_tokens for p in got] == [len(prompt), len(prompt) + len(tokens) - 1]
    for prefix in got:
        _assert_every_rank_heads(engines["2"], prefix)


def test_a_request_the_caller_finishes_is_retained_whole_and_the_ranks_stay_in_step(engines, reference):
    engine = engines["2"]
    prompt = list(range(120, 120 + 2 * UNIT + 3))
    got: list[RetainedPrefix] = []
    engine.set_retention_listener(got.append)
    try:
        request = engine.add_request("ended", prompt, SamplingParams(temperature=0, max_tokens=40))
        while len(request.output_token_ids) < 3:
            engine.step()
        engine.finish_request("ended", "stop")  # a stop string the caller found: what it computed is kept
        assert got[-1].num_tokens == request.num_computed_tokens > len(prompt)
        _assert_every_rank_heads(engine, got[-1])
        after = list(range(200, 230))
        assert _retained(engine, after, "after")[1] == reference(
            after
        )  # the next call finds the ranks in step
    finally:
        engine.set_retention_listener(None)


@pytest.mark.parametrize(
    "published_at,imported_at,start", [("2", "1", 400), ("1", "2", 600), ("2", "2'", 800)]
)
def test_a_prefix_retained_at_one_width_is_imported_at_another(
    engines, reference, published_at, imported_at, start
):
    first = list(range(start, start + 3 * UNIT + 4))  # a prompt no engine has seen
    second = first + list(range(start + 60, start + 75))
    got, _ = _retained(engines[published_at], first, f"pub-{published_at}-{imported_at}")
    prefix = next(p for p in got if p.num_tokens == len(first))
    engine = engines[imported_at]
    imported_before = engine.prefix_cache_stats().num_imported_tokens
    request = engine.add_request(
        f"imp-{published_at}-{imported_at}",
        second,
        PARAMS,
        imported_prefix=ImportedPrefix(prefix.num_tokens, prefix.hash_chain, prefix.states),
    )
    _run(engine)
    assert request.output_token_ids == reference(second)
    assert engine.prefix_cache_stats().num_imported_tokens == imported_before + len(first)
