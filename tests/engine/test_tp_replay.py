"""ReplaySSM publishes of a tensor-parallel decode, and a resume from them at another width.

A width-2 decode engine with `replay_window` publishes, every window, the MLA rows once and each KDA
layer's conv state and records or checkpoint as one piece per rank naming its heads (the ranks
collect the same publishes as rank 0 and send it their shares after the step). Stored (the
codec's states) and read back, the pieces of either width rebuild the request's state whole; an
engine of the other width resumes from any publish with exactly the uninterrupted run's tokens. A
publish the listener refuses is refused on every rank: the next one is a checkpoint on all."""

from __future__ import annotations

import pytest

from splitserve import SamplingParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.replay_codec import kda_states, mla_states, publish_from_states
from splitserve.engine.replay_publish import ReplayPublish
from splitserve.engine.replay_resume import resume_states
from splitserve.engine.state_transfer import LayerState
from splitserve.engine_config import EngineConfig
from splitserve.state import HeadRange, StateKind
from tests.engine.test_replay_resume import _run

PROMPT = [3 + (i * 11) % 500 for i in range(45)]
WINDOW = 4
NUM_TOKENS = 19
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    config = EngineConfig(model=str(tiny_model_path), dtype="float32", max_model_len=256)
    built = {
        "prefill": LLMEngine(config),
        1: LLMEngine(config.replace(replay_window=WINDOW)),
        2: LLMEngine(config.replace(replay_window=WINDOW, tensor_parallel_size=2)),
    }
    yield built
    built[2].shutdown()


@pytest.fixture(scope="module")
def prefilled(engines) -> tuple[list[LayerState], list[int]]:
    """The prompt's state and the uninterrupted run's tokens (one engine, no failover)."""
    states: list[LayerState] = []
    engines["prefill"].add_request("prompt", PROMPT, PARAMS, export=states.append)
    _run(engines["prefill"])
    engines["prefill"].add_request("whole", PROMPT, PARAMS)
    return states, _run(engines["prefill"])


def _decode(engine: LLMEngine, rid: str, states: list[LayerState], tokens: list[int], done: int) -> list[int]:
    """Admit `rid` with `states` (of the prompt and the first `done` tokens) and decode to the end."""
    assert engine.reserve_transfer(rid, len(PROMPT) + done)
    for state in states:
        engine.write_transferred_state(rid, state)
    engine.admit_transferred(rid, PROMPT, PARAMS, tokens[done], output_token_ids=tokens[:done] or None)
    return [*tokens[: done + 1], *_run(engine)]


def _published(engine: LLMEngine, rid: str, prefilled, refuse_at: int = -1) -> list[ReplayPublish]:
    """Decode `rid` from the prompt state on `engine`, keeping its publishes (refusing the one that
    ends at token `refuse_at`, as a full queue does); asserts the uninterrupted run's tokens."""
    prompt_states, tokens = prefilled
    pieces: list[ReplayPublish] = []

    def listen(piece: ReplayPublish) -> bool:
        if piece.num_tokens == refuse_at:
            return False
        pieces.append(piece)
        return True

    engine.set_replay_listener(listen)
    try:
        assert _decode(engine, rid, prompt_states, tokens, 0) == tokens
    finally:
        engine.set_replay_listener(None)
    return pieces


def _stored(piece: ReplayPublish, head_dims: tuple[int, int]) -> ReplayPublish:
    """`piece` as a store keeps it (its MLA rows and KDA part as states) and a reader reads it back."""
    return publish_from_states(piece.request_id, mla_states(piece) + kda_states(piece), head_dims)


def _head_dims(states: list[LayerState]) -> tuple[int, int]:
    recurrent = next(s for s in states if s.kind is StateKind.KDA_RECURRENT)
    return int(recurrent.tensor.shape[-2]), int(recurrent.tensor.shape[-1])


@pytest.mark.parametrize("publish_size,resume_size", [(2, 1), (1, 2), (2, 2)])
def test_a_publish_at_one_width_resumes_at_another_exactly(engines, prefilled, publish_size, resume_size):
    prompt_states, tokens = prefilled
    pieces = _published(engines[publish_size], f"w{publish_size}{resume_size}", prefilled)
    n, mc = len(PROMPT), engines[1].model_config
    assert [p.num_tokens for p in pieces] == list(range(n + WINDOW, n + NUM_TOKENS, WINDOW))
    num_heads = mc.linear_num_heads
    halves = {HeadRange(0, num_heads // 2, num_heads), HeadRange(num_heads // 2, num_heads, num_heads)}
    for piece in pieces:  # one KDA piece per rank and layer, naming its heads; the MLA rows once
        assert len(piece.kda) == len(mc.kda_layer_ids) * publish_size
        assert {p.heads for p in piece.kda} == (halves if publish_size == 2 else {None})
        assert len(piece.mla) == len(mc.mla_layer_ids)
        assert len({p.checkpoint is None for p in piece.kda}) == 1  # every rank publishes alike
    stored = [_stored(p, _head_dims(prompt_states)) for p in pieces]
    for m in (0, 1, len(stored) - 1):  # after records, after a checkpoint, the last
        num_tokens, states = resume_states(prompt_states, stored[: m + 1])
        done = num_tokens - n
        resumed = _decode(engines[resume_size], f"r{publish_size}{resume_size}-{m}", states, tokens, done)
        assert resumed == tokens


def test_a_refused_publish_is_refused_on_every_rank(engines, prefilled):
    """The listener refuses the second publish (a checkpoint at n + 8): rank 0's next publish
    starts at the last one kept and carries a checkpoint; so do the other ranks' pieces of it
    (without following rank 0 a rank would send records there, extending what it alone kept)."""
    prompt_states, tokens = prefilled
    n = len(PROMPT)
    pieces = _published(engines[2], "refused", prefilled, refuse_at=n + 2 * WINDOW)
    after = pieces[1]
    assert (after.token_start, after.num_tokens) == (n + WINDOW, n + 3 * WINDOW)
    assert all(p.checkpoint is not None for p in after.kda)
    stored = [_stored(p, _head_dims(prompt_states)) for p in pieces]
    num_tokens, states = resume_states(prompt_states, stored)
    done = num_tokens - n
    assert _decode(engines[1], "refused-resumed", states, tokens, done) == tokens


def test_a_step_that_publishes_and_retains_keeps_every_ranks_shares_apart(engines, tiny_model_path):
    """Prefix caching and ReplaySSM on one TP=2 engine, both listening: requests decoding in step,
    the shorter ones finishing (retained, every rank's KDA heads) in the very steps the longer
    ones fold a window (published, every rank's pieces). Rank 0 reads each rank's messages of a
    step in the order the rank sends them; the tokens are the one-rank engine's."""
    config = EngineConfig(
        model=str(tiny_model_path),
        dtype="float32",
        max_model_len=256,
        replay_window=WINDOW,
        enable_prefix_caching=True,
        prefix_unit=16,
        tensor_parallel_size=2,
    )
    # prefilled in one step, they decode in step: the one that ends at 9 tokens finishes (retained)
    # in the step the others fold their second window, the one of 13 as the last folds its third
    lengths = {f"both-{i}": WINDOW * (i + 2) + 1 for i in range(3)}
    prompts = {rid: [7 + (i * 13 + 5 * n) % 400 for i in range(20)] for rid, n in lengths.items()}

    def params(rid: str) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=lengths[rid], ignore_eos=True)

    reference = engines["prefill"]
    expected = {}
    for rid, prompt in prompts.items():
        expected[rid] = reference.add_request(f"ref-{rid}", prompt, params(rid))
        _run(reference)
    engine = LLMEngine(config)
    retained, published = [], []
    try:
        engine.set_retention_listener(retained.append)
        engine.set_replay_listener(lambda piece: published.append(piece) or True)
        requests = {rid: engine.add_request(rid, prompt, params(rid)) for rid, prompt in prompts.items()}
        _run(engine)
    finally:
        engine.shutdown()
    assert {rid: r.output_token_ids for rid, r in requests.items()} == {
        rid: r.output_token_ids for rid, r in expected.items()
    }
    num_kda = len(engine.model_config.kda_layer_ids)
    # each request publishes at every window it folds before its last token: 1 + 2 + 3
    assert len(published) == 6 and all(len(p.kda) == 2 * num_kda for p in published)
    assert sorted(p.num_tokens for p in retained) == [20, 20, 20, 28, 32, 36]  # prompts, then each whole
    for prefix in retained:  # two KDA pieces (conv, recurrent) per layer and rank
        assert len([s for s in prefix.states if s.kind is not StateKind.MLA_KV]) == 2 * 2 * num_kda
