"""A prompt's state handed between engines of different tensor-parallel widths: a prefill at width a
exports each KDA state as one piece per rank (naming its heads) and the MLA rows once; a decode at
width b takes them through its reservation, each rank getting exactly its heads, and greedy decoding
(and seeded samples forked on admission) gives the tokens of one engine that computed it all. Pieces arrive in any order (a store interleaves
ranks' objects), one request may be aborted mid-transfer, and the ranks stay in step."""

from __future__ import annotations

import random

import pytest

from splitserve import SamplingParams
from splitserve.engine.llm_engine import HANDOFF, LLMEngine
from splitserve.engine.parallel_sampling import SampleStart
from splitserve.engine.state_transfer import LayerState
from splitserve.engine_config import EngineConfig
from splitserve.state import HeadRange, StateKind

PROMPTS = [[7, 8, 9], list(range(3, 90)), [44] * 20 + list(range(50, 80))]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(path, size: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(path), dtype="float32", max_model_len=256, tensor_parallel_size=size)
    )


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests:
        engine.step()


@pytest.fixture(scope="module")
def engines(tiny_model_path):
    built = {size: _engine(tiny_model_path, size) for size in (1, 2)}
    yield built
    for engine in built.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(engines):
    one = engines[1]
    requests = [one.add_request(f"ref{i}", p, PARAMS) for i, p in enumerate(PROMPTS)]
    _run(one)
    return [r.output_token_ids for r in requests]


def _prefill(engine: LLMEngine, tag: str) -> tuple[list[list[LayerState]], list[int]]:
    states: list[list[LayerState]] = [[] for _ in PROMPTS]
    requests = [
        engine.add_request(f"{tag}{i}", p, PARAMS, export=states[i].append) for i, p in enumerate(PROMPTS)
    ]
    _run(engine)
    assert all(r.finish_reason == HANDOFF for r in requests)
    return states, [r.output_token_ids[0] for r in requests]


@pytest.mark.parametrize("prefill_size,decode_size", [(2, 1), (1, 2), (2, 2)])
def test_a_prefill_at_one_width_hands_off_to_a_decode_at_another(
    engines, reference, prefill_size, decode_size
):
    prefill, decode = engines[prefill_size], engines[decode_size]
    tag = f"p{prefill_size}d{decode_size}-"
    states, firsts = _prefill(prefill, tag)
    num_heads = prefill.model_config.linear_num_heads
    for pieces in states:
        kda = [s for s in pieces if s.kind is not StateKind.MLA_KV]
        mla = [s for s in pieces if s.kind is StateKind.MLA_KV]
        # one piece per rank per KDA state, naming its heads; the MLA rows once (rank 0's latent)
        assert len(kda) == 2 * len(prefill.model_config.kda_layer_ids) * prefill_size
        if prefill_size == 2:
            assert {s.heads for s in kda} == {
                HeadRange(0, num_heads // 2, num_heads),
                HeadRange(num_heads // 2, num_heads, num_heads),
            }
        else:
            assert {s.heads for s in kda} == {None}
        assert {s.layer_id for s in mla} == set(prefill.model_config.mla_layer_ids)
    outputs = []
    for i, prompt in enumerate(PROMPTS):
        rid = f"{tag}{i}"
        assert decode.reserve_transfer(rid, len(prompt))
        pieces = list(states[i])
        random.Random(i).shuffle(pieces)  # a store interleaves the ranks' objects
        for piece in pieces:
            decode.write_transferred_state(rid, piece)
        outputs.append(decode.admit_transferred(rid, prompt, PARAMS, firsts[i]))
    _run(decode)
    assert [r.output_token_ids for r in outputs] == reference
    # pieces written to rank 0 reach the other rank cut to its heads (no reads of their own here)
    assert (decode.num_forwarded_pieces > 0) == (decode_size > 1)


def test_a_reservation_aborted_mid_transfer_leaves_the_ranks_in_step(engines, reference):
    one, two = engines[1], engines[2]
    states, firsts = _prefill(one, "abort-src-")
    assert two.reserve_transfer("gone", len(PROMPTS[1]))
    for piece in states[1][: len(states[1]) // 2]:
        two.write_transferred_state("gone", piece)
    two.abort_request("gone")
    with pytest.raises(KeyError, match="no reservation"):
        two.write_transferred_state("gone", states[1][-1])
    assert two.scheduler.blocks.num_free_blocks == two.plan.num_blocks
    # the same room again, and a whole transfer into it: the ranks agree on blocks and slots
    assert two.reserve_transfer("again", len(PROMPTS[1]))
    for piece in states[1]:
        two.write_transferred_state("again", piece)
    request = two.admit_transferred("again", PROMPTS[1], PARAMS, firsts[1])
    _run(two)
    assert request.output_token_ids == reference[1]


SEEDED = SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=41, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("prefill_size,decode_size", [(2, 1), (1, 2)])
def test_samples_of_one_prompt_hand_off_across_widths(engines, prefill_size, decode_size):
    """n = 3 seeded samples: one prefill exports the prompt's state once (the samples' own engine
    ids on every rank), the decode forks it on admission; the samples equal one engine's run."""
    prefill, decode, one = engines[prefill_size], engines[decode_size], engines[1]
    prompt, rid = PROMPTS[1], f"n-p{prefill_size}d{decode_size}"
    whole = one.add_request(f"{rid}-ref", prompt, SEEDED)
    reference_samples = [whole, *whole.samples_to_fork]
    _run(one)
    expected = [r.output_token_ids for r in reference_samples]
    states: list[LayerState] = []
    first = prefill.add_request(rid, prompt, SEEDED, export=states.append)
    samples = [first, *first.samples_to_fork]
    _run(prefill)
    assert [s.finish_reason for s in samples] == [HANDOFF] * 3
    assert decode.reserve_transfer(rid, len(prompt), num_samples=3)
    for piece in states:
        decode.write_transferred_state(rid, piece)
    starts = [SampleStart(s.output_token_ids[0]) for s in samples]
    admitted = decode.admit_transferred_samples(rid, prompt, SEEDED, starts)
    _run(decode)
    assert [r.output_token_ids for r in admitted] == expected
