"""Decode failover by re-prefill, inside the engine: a request resumed from prompt + the tokens it
already generated continues with exactly the tokens an uninterrupted run gives (greedy, seeded,
penalties), whether the resumed engine decodes itself or exports its state to a decode engine."""

from __future__ import annotations

import pytest

from splitserve import SamplingParams
from splitserve.engine.llm_engine import HANDOFF, LLMEngine
from splitserve.engine.state_transfer import LayerState
from splitserve.engine_config import EngineConfig

PROMPT = [5 + (i * 7) % 300 for i in range(70)]
NUM_TOKENS = 12

PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=NUM_TOKENS, ignore_eos=True),
    "penalties": SamplingParams(
        temperature=0.8,
        seed=3,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        max_tokens=NUM_TOKENS,
        ignore_eos=True,
    ),
}


@pytest.fixture(scope="module")
def engines(tiny_model_path) -> tuple[LLMEngine, LLMEngine]:
    config = EngineConfig(model=str(tiny_model_path), max_model_len=512)
    return LLMEngine(config), LLMEngine(config)


def _finish(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests:
        engine.step()


def _uninterrupted(engine: LLMEngine, params: SamplingParams) -> list[int]:
    request = engine.add_request("whole", PROMPT, params)
    _finish(engine)
    return request.output_token_ids


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("num_sent", [1, 5, NUM_TOKENS - 1])
def test_resumed_request_continues_exactly(engines, name, num_sent):
    engine, _ = engines
    params = PARAMS[name]
    expected = _uninterrupted(engine, params)
    resumed = engine.add_request("resumed", PROMPT, params, output_token_ids=expected[:num_sent])
    _finish(engine)
    assert resumed.output_token_ids == expected
    assert resumed.finish_reason == "length"  # max_tokens counted the tokens it was given


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_resumed_prefill_hands_off_prompt_plus_outputs(engines, name):
    """The failover path across engines: re-prefill exports prompt + sent tokens, decode admits."""
    prefill, decode = engines
    params = PARAMS[name]
    expected = _uninterrupted(prefill, params)
    sent = expected[:4]
    states: list[LayerState] = []
    request = prefill.add_request("r", PROMPT, params, export=states.append, output_token_ids=sent)
    num_state_tokens = len(PROMPT) + len(sent)
    assert decode.reserve_transfer("r", num_state_tokens)
    _finish(prefill)
    assert request.finish_reason == HANDOFF and request.output_token_ids == expected[:5]
    assert {s.prompt_len for s in states} == {num_state_tokens}
    for state in states:
        decode.write_transferred_state("r", state)
    admitted = decode.admit_transferred("r", PROMPT, params, expected[4], output_token_ids=sent)
    _finish(decode)
    assert admitted.output_token_ids == expected


def test_resume_refuses_what_does_not_fit(engines):
    engine, _ = engines
    params = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match="nothing is left to generate"):
        engine.add_request("full", PROMPT, params, output_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", PROMPT, params, output_token_ids=[10**9])
    assert "full" not in engine.requests and "bad" not in engine.requests


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_resume_with_prefix_caching_on_continues_exactly(tiny_model_path, name):
    """The cluster default: the re-prefill may start at a cached prefix of the prompt (its first
    run left one), and the handoff still carries prompt + sent tokens whole."""
    config = EngineConfig(
        model=str(tiny_model_path),
        max_model_len=512,
        enable_prefix_caching=True,
        prefix_unit=16,
        block_size=16,
    )
    prefill, decode = LLMEngine(config), LLMEngine(config)
    params = PARAMS[name]
    expected = _uninterrupted(prefill, params)
    sent = expected[:6]
    states: list[LayerState] = []
    request = prefill.add_request("r", PROMPT, params, export=states.append, output_token_ids=sent)
    assert decode.reserve_transfer("r", len(PROMPT) + len(sent))
    _finish(prefill)
    assert request.finish_reason == HANDOFF and request.output_token_ids == expected[:7]
    assert request.num_cached_tokens > 0  # the re-prefill did start at the first run's prefix
    for state in states:
        decode.write_transferred_state("r", state)
    admitted = decode.admit_transferred("r", PROMPT, params, expected[6], output_token_ids=sent)
    _finish(decode)
    assert admitted.output_token_ids == expected
    resumed_here = prefill.add_request("again", PROMPT, params, output_token_ids=expected[:3])
    _finish(prefill)
    assert resumed_here.output_token_ids == expected


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_resume_whose_prefix_hit_reaches_into_the_sent_tokens_hands_off_every_row(tiny_model_path, name):
    """Decode failover with caching on, where an earlier request with this prompt finished after
    fewer tokens than the stream had sent (a retry, a shorter `max_tokens`): its retained end lies
    past the prompt, inside the sent tokens, so the re-prefill starts there. The handoff must still
    carry every MLA row from token 0; it once shipped only the rows it computed (the hit was
    counted as prompt tokens only, capped at the prompt), and the decode waited for rows that
    never came ("state ... ended short")."""
    config = EngineConfig(
        model=str(tiny_model_path),
        max_model_len=512,
        enable_prefix_caching=True,
        prefix_unit=16,
        block_size=16,
    )
    prefill, decode = LLMEngine(config), LLMEngine(config)
    params = PARAMS[name]
    expected = _uninterrupted(prefill, params)
    short = prefill.add_request("short", PROMPT, params.replace(max_tokens=4))
    _finish(prefill)
    assert short.output_token_ids == expected[:4]
    sent = expected[:8]
    states: list[LayerState] = []
    request = prefill.add_request("r", PROMPT, params, export=states.append, output_token_ids=sent)
    num_state_tokens = len(PROMPT) + len(sent)
    assert decode.reserve_transfer("r", num_state_tokens)
    _finish(prefill)
    assert request.finish_reason == HANDOFF and request.output_token_ids == expected[:9]
    rows = {}
    for state in states:
        if state.kind.name == "MLA_KV":
            rows.setdefault(state.layer_id, set()).update(range(state.token_start, state.token_end))
    assert rows and all(r == set(range(num_state_tokens)) for r in rows.values()), {
        k: (min(v), max(v), len(v)) for k, v in rows.items()
    }
    for state in states:
        decode.write_transferred_state("r", state)
    admitted = decode.admit_transferred("r", PROMPT, params, expected[8], output_token_ids=sent)
    _finish(decode)
    assert admitted.output_token_ids == expected
