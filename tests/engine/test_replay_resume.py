"""A request decoding in ReplaySSM form publishes its state every window; the prompt state plus the
pieces up to any publish rebuild, on a second engine, exactly the state an uninterrupted run had
there, and the resumed request continues with the uninterrupted run's tokens (greedy and seeded).
A resumed engine's own publishes (a checkpoint first) chain on for a second failover."""

from __future__ import annotations

import pytest
import torch

from splitserve import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.replay_publish import ReplayPublish
from splitserve.engine.replay_resume import resume_states, stack_mla_rows
from splitserve.engine.state_transfer import LayerState
from splitserve.engine_config import EngineConfig
from splitserve.state import StateKind

PROMPT = [3 + (i * 11) % 500 for i in range(45)]
WINDOW = 4
NUM_TOKENS = 19

PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=NUM_TOKENS, ignore_eos=True),
}


@pytest.fixture(scope="module")
def engines(tiny_model_path) -> dict[str, LLMEngine]:
    config = EngineConfig(model=str(tiny_model_path), max_model_len=256)
    return {
        "prefill": LLMEngine(config),
        "decode": LLMEngine(config.replace(replay_window=WINDOW)),
        "resume": LLMEngine(config.replace(replay_window=WINDOW)),
    }


def _run(engine: LLMEngine) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests:
        for update in engine.step():
            tokens += update.new_token_ids
    return tokens


def _prefill(engine: LLMEngine, params: SamplingParams, earlier: list[int] | None = None):
    states: list[LayerState] = []
    engine.add_request("p", PROMPT, params, export=states.append, output_token_ids=earlier)
    (first,) = _run(engine)
    return states, first


def _decode(engine: LLMEngine, rid: str, params, states, first: int, earlier: list[int]) -> list[int]:
    num_tokens = len(PROMPT) + len(earlier)
    assert engine.reserve_transfer(rid, num_tokens)
    for state in states:
        engine.write_transferred_state(rid, state)
    engine.admit_transferred(rid, PROMPT, params, first, output_token_ids=earlier or None)
    return [*earlier, first, *_run(engine)]


def _published(engine: LLMEngine, run) -> tuple[list[int], list[ReplayPublish]]:
    pieces: list[ReplayPublish] = []
    engine.set_replay_listener(pieces.append)
    try:
        return run(), pieces
    finally:
        engine.set_replay_listener(None)


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_resume_from_any_publish_continues_like_the_uninterrupted_run(engines, kind):
    params = PARAMS[kind]
    prompt_states, first = _prefill(engines["prefill"], params)
    tokens, pieces = _published(
        engines["decode"], lambda: _decode(engines["decode"], "a", params, prompt_states, first, [])
    )
    assert len(tokens) == NUM_TOKENS
    n = len(PROMPT)
    assert [p.num_tokens for p in pieces] == list(range(n + WINDOW, n + NUM_TOKENS, WINDOW))
    # tiny heads (16 x 16): 4 tokens of records (4 x 48 values) fit in a checkpoint (256), 8 do not
    assert [p.has_checkpoint for p in pieces] == [m % 2 == 1 for m in range(len(pieces))]
    assert all((p.kda[0].k is None) == p.has_checkpoint for p in pieces)
    _assert_records_since_a_checkpoint_fit_in_one(pieces)
    for m, piece in enumerate(pieces):
        num_tokens, states = resume_states(prompt_states, pieces[: m + 1])
        assert num_tokens == piece.num_tokens
        done = num_tokens - n
        # the rebuilt state equals the state a prefill of prompt + those tokens computes
        expected, _ = _prefill(engines["prefill"], params, tokens[:done])
        _assert_same_state(states, expected)
        resumed = _decode(engines["resume"], f"b{m}", params, states, tokens[done], tokens[:done])
        assert resumed == tokens


def test_a_resumed_engine_publishes_a_checkpoint_then_records(engines):
    params = PARAMS["greedy"]
    prompt_states, first = _prefill(engines["prefill"], params)
    tokens, pieces = _published(
        engines["decode"], lambda: _decode(engines["decode"], "c", params, prompt_states, first, [])
    )
    num_tokens, states = resume_states(prompt_states, pieces[:1])
    done = num_tokens - len(PROMPT)
    resumed, more = _published(
        engines["resume"],
        lambda: _decode(engines["resume"], "d", params, states, tokens[done], tokens[:done]),
    )
    assert resumed == tokens
    assert more[0].token_start == len(PROMPT) and more[0].kda[0].checkpoint is not None
    assert more[1].kda[0].k is not None
    _assert_records_since_a_checkpoint_fit_in_one(more)
    # a second failover: the first engine's piece, then the resumed engine's, rebuild the state
    end, chained = resume_states(prompt_states, [pieces[0], *more])
    expected, _ = _prefill(engines["prefill"], params, tokens[: end - len(PROMPT)])
    _assert_same_state(chained, expected)


def test_a_gap_in_the_pieces_is_refused(engines):
    params = PARAMS["greedy"]
    prompt_states, first = _prefill(engines["prefill"], params)
    _, pieces = _published(
        engines["decode"], lambda: _decode(engines["decode"], "e", params, prompt_states, first, [])
    )
    with pytest.raises(ValueError, match="a piece is missing"):
        resume_states(prompt_states, [pieces[0], pieces[2]])


def _assert_records_since_a_checkpoint_fit_in_one(pieces: list[ReplayPublish]) -> None:
    """What bounds the KDA bytes a store keeps: per layer, the records published since the last
    checkpoint (the prompt's end counts as one) never cost more than one checkpoint."""
    since: dict[int, int] = {}
    for piece in pieces:
        for layer in piece.kda:
            if layer.checkpoint is not None:
                since[layer.layer_id] = 0
            else:
                assert layer.k is not None and layer.u is not None and layer.g_cum is not None
                since[layer.layer_id] = since.get(layer.layer_id, 0) + sum(
                    t.numel() for t in (layer.k, layer.u, layer.g_cum)
                )
                heads, dk, dv = layer.k.shape[1], layer.k.shape[2], layer.u.shape[2]
                assert since[layer.layer_id] <= heads * dk * dv


def _assert_same_state(got: list[LayerState], expected: list[LayerState]) -> None:
    def kda(states):
        return {(s.layer_id, s.kind): s.tensor for s in states if s.kind is not StateKind.MLA_KV}

    got_kda, expected_kda = kda(got), kda(expected)
    assert got_kda.keys() == expected_kda.keys()
    for key, tensor in expected_kda.items():
        torch.testing.assert_close(got_kda[key], tensor, atol=1e-4, rtol=1e-4)
    got_mla, expected_mla = stack_mla_rows(got), stack_mla_rows(expected)
    assert got_mla.keys() == expected_mla.keys()
    for lid, rows in expected_mla.items():
        torch.testing.assert_close(got_mla[lid], rows, atol=1e-4, rtol=1e-4)


def test_a_window_whose_records_outweigh_the_checkpoint_publishes_checkpoints(tiny_model_path, engines):
    """Tiny heads (16 x 16): 8 records of 3 x 16 values cost more than the 16 x 16 checkpoint."""
    decode = LLMEngine(EngineConfig(model=str(tiny_model_path), max_model_len=256, replay_window=8))
    params = PARAMS["greedy"]
    prompt_states, first = _prefill(engines["prefill"], params)
    tokens, pieces = _published(decode, lambda: _decode(decode, "f", params, prompt_states, first, []))
    assert pieces and all(p.kda[0].checkpoint is not None and p.kda[0].k is None for p in pieces)
    num_tokens, states = resume_states(prompt_states, pieces)
    done = num_tokens - len(PROMPT)
    assert _decode(engines["resume"], "g", params, states, tokens[done], tokens[:done]) == tokens
