"""ReplaySSM publishes as stored state: every piece (records or checkpoint) survives the trip
through the store's chunk encoding unchanged and rebuilds the same state; a publish the listener
refuses (its queue full) is not lost: the next one starts where the last taken one ended, as a
checkpoint, so the pieces taken still chain."""

from __future__ import annotations

import torch

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.replay_codec import piece_key, publish_from_states, publish_states
from splitserve.engine.replay_publish import ReplayPublish
from splitserve.engine.replay_resume import resume_states, stack_mla_rows
from splitserve.engine.state_codec import decode_pieces, encode
from splitserve.engine_config import EngineConfig
from splitserve.state import StateKind
from tests.engine import test_replay_resume
from tests.engine.test_replay_resume import PARAMS, PROMPT, _decode, _prefill, _published

replay_engines = test_replay_resume.engines  # that module's prefill, decode and resume engines


def _stored(piece: ReplayPublish, head_dims: tuple[int, int]) -> ReplayPublish:
    """`piece` written as a store key's chunks (small ones: MLA rows split) and read back."""
    key = piece_key("worker/req", piece.token_start)
    chunks = [c for state in publish_states(piece) for c in encode(state, key, max_chunk_bytes=1024)]
    return publish_from_states(piece.request_id, decode_pieces(chunks), head_dims)


def _assert_same_piece(got: ReplayPublish, want: ReplayPublish) -> None:
    assert (got.token_start, got.num_tokens) == (want.token_start, want.num_tokens)
    assert [p.layer_id for p in got.kda] == [p.layer_id for p in want.kda]
    for g, w in zip(got.kda, want.kda):
        for name in ("conv", "k", "u", "g_cum", "checkpoint"):
            a, b = getattr(g, name), getattr(w, name)
            assert (a is None) == (b is None), name
            if b is not None:
                assert torch.equal(a, b), name
    for g, w in zip(stack_mla_rows(got.mla).values(), stack_mla_rows(want.mla).values(), strict=True):
        assert torch.equal(g, w)


def _head_dims(prompt_states) -> tuple[int, int]:
    recurrent = next(s for s in prompt_states if s.kind is StateKind.KDA_RECURRENT)
    return int(recurrent.tensor.shape[-2]), int(recurrent.tensor.shape[-1])


def test_records_and_checkpoints_survive_the_store_encoding(tiny_model_path, replay_engines):
    params = PARAMS["greedy"]
    prompt_states, first = _prefill(replay_engines["prefill"], params)
    dims = _head_dims(prompt_states)
    _, records = _published(
        replay_engines["decode"],
        lambda: _decode(replay_engines["decode"], "codec-r", params, prompt_states, first, []),
    )
    wide = LLMEngine(EngineConfig(model=str(tiny_model_path), max_model_len=256, replay_window=8))
    _, checkpoints = _published(wide, lambda: _decode(wide, "codec-c", params, prompt_states, first, []))
    assert records[0].kda[0].k is not None and checkpoints[0].kda[0].checkpoint is not None
    for pieces in (records, checkpoints):
        back = [_stored(p, dims) for p in pieces]
        for got, want in zip(back, pieces, strict=True):
            _assert_same_piece(got, want)
        end, states = resume_states(prompt_states, back)
        end_want, states_want = resume_states(prompt_states, pieces)
        assert end == end_want
        for got, want in zip(states, states_want, strict=True):
            assert torch.equal(got.tensor, want.tensor)


def test_a_refused_publish_makes_the_next_one_a_checkpoint_that_closes_the_gap(replay_engines):
    params = PARAMS["greedy"]
    prompt_states, first = _prefill(replay_engines["prefill"], params)
    engine = replay_engines["decode"]
    taken: list[ReplayPublish] = []

    def listener(piece: ReplayPublish) -> bool:
        if len(taken) == 1 and not hasattr(listener, "refused"):
            listener.refused = piece  # type: ignore[attr-defined]
            return False  # the queue is full
        taken.append(piece)
        return True

    engine.set_replay_listener(listener)
    try:
        tokens = _decode(engine, "refused", params, prompt_states, first, [])
    finally:
        engine.set_replay_listener(None)
    assert len(taken) >= 2
    assert taken[1].token_start == taken[0].num_tokens  # no gap where the refused one was
    assert taken[1].kda[0].checkpoint is not None  # it cannot extend records nobody kept
    assert all(p.kda[0].k is not None for p in taken[2:])  # then records again
    end, states = resume_states(prompt_states, taken)
    done = end - len(PROMPT)
    assert (
        _decode(replay_engines["resume"], "refused-b", params, states, tokens[done], tokens[:done]) == tokens
    )
