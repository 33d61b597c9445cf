"""`n` samples from one prefill: each sample equals a separate request seeded seed + i (vLLM's
rule), greedy samples are identical, the prompt is computed once and its KV blocks are shared
(one copy of the prompt, a private copy of a partial last block per sample), on one engine, on a
decode engine that forks on admission, with ReplaySSM rings and when no slot is free."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.llm_engine import HANDOFF, LLMEngine
from splitserve.engine.parallel_sampling import SampleStart
from splitserve.engine.state_transfer import LayerState
from splitserve.engine_config import EngineConfig
from splitserve.sampling_params import sample_request_id

PROMPT = [5 + (i * 7) % 300 for i in range(100)]  # 100 tokens: 6 whole blocks of 16, 4 rows in a 7th
SEEDED = SamplingParams(n=3, temperature=0.9, top_p=0.9, seed=41, max_tokens=8, ignore_eos=True)


def _engine(path, **kwargs: object) -> LLMEngine:
    config = dict(model=str(path), max_model_len=512, block_size=16)
    config.update(kwargs)
    return LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]


def _separate(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Each sample as a request of its own, seeded seed + i."""
    requests = [
        engine.add_request(f"alone-{i}-{id(params)}", prompt, params.replace(n=1, seed=params.seed + i))
        for i in range(params.n)
    ]
    while engine.has_unfinished_requests:
        engine.step()
    return [r.output_token_ids for r in requests]


def _samples(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    """A request's samples, run to the end; the tokens the steps computed."""
    first = engine.add_request(request_id, prompt, params)
    samples = [first, *first.samples_to_fork]
    num_computed = 0
    while engine.has_unfinished_requests:
        num_computed += _count_step(engine)
    return samples, num_computed


def _count_step(engine: LLMEngine) -> int:
    """One step; the tokens it computed."""
    counted: list[int] = []
    execute = engine.runner.execute

    def counting(scheduled, *rest):  # type: ignore[no-untyped-def]
        counted.append(sum(s.num_new_tokens for s in scheduled))
        return execute(scheduled, *rest)

    engine.runner.execute = counting  # type: ignore[method-assign]
    try:
        engine.step()
    finally:
        engine.runner.execute = execute  # type: ignore[method-assign]
    return sum(counted)


@pytest.fixture(scope="module")
def reference(tiny_model_path) -> LLMEngine:
    return _engine(tiny_model_path)


@pytest.mark.parametrize("caching", [False, True])
def test_seeded_samples_equal_separate_requests_from_one_prefill(tiny_model_path, reference, caching):
    engine = _engine(tiny_model_path, enable_prefix_caching=caching)
    samples, num_computed = _samples(engine, "r", PROMPT, SEEDED)
    assert [s.request_id for s in samples] == [sample_request_id("r", i) for i in range(3)]
    assert [s.output_token_ids for s in samples] == _separate(reference, PROMPT, SEEDED)
    assert len({tuple(s.output_token_ids) for s in samples}) == 3, "seeds 41, 42, 43 draw differently"
    # the prompt once, then each sample's tokens after its first (drawn from the prompt's logits)
    assert num_computed == len(PROMPT) + 3 * (SEEDED.max_tokens - 1)
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks, "every shared block went back"


def test_greedy_samples_are_identical(tiny_model_path, reference):
    greedy = SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True)
    samples, _ = _samples(_engine(tiny_model_path), "g", PROMPT, greedy)
    alone = _separate(reference, PROMPT, greedy.replace(seed=0))
    assert [s.output_token_ids for s in samples] == [alone[0]] * 4


def test_unseeded_samples_draw_independently(tiny_model_path):
    params = SamplingParams(n=4, temperature=1.5, max_tokens=8, ignore_eos=True)
    samples, _ = _samples(_engine(tiny_model_path), "u", PROMPT, params)
    assert len({tuple(s.output_token_ids) for s in samples}) > 1


def test_samples_share_the_prompts_blocks(tiny_model_path):
    engine = _engine(tiny_model_path)
    blocks = engine.scheduler.blocks
    first = engine.add_request("s", PROMPT, SEEDED.replace(n=4, max_tokens=3))
    samples = [first, *first.samples_to_fork]
    engine.step()  # the whole prompt, then every sample's first token and the forks
    assert all(len(s.output_token_ids) == 1 for s in samples)
    # one copy of the prompt's 7 blocks, and a private copy of its partial 7th for 3 samples
    assert blocks.num_blocks - blocks.num_free_blocks == 7 + 3
    shared = first.block_table[:6]
    assert all(s.block_table[:6] == shared for s in samples)
    assert all(blocks.ref_count(b) == 4 for b in shared)
    assert len({s.block_table[6] for s in samples}) == 4
    assert len({s.state_slot for s in samples}) == 4
    while engine.has_unfinished_requests:
        engine.step()
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_sample_without_a_free_slot_computes_its_prompt_and_equals_the_others(tiny_model_path, reference):
    engine = _engine(tiny_model_path, max_num_seqs=2)
    samples, num_computed = _samples(engine, "f", PROMPT, SEEDED)
    assert [s.output_token_ids for s in samples] == _separate(reference, PROMPT, SEEDED)
    # sample 2 waited for a slot and then computed the prompt and its first token itself
    assert num_computed == 2 * len(PROMPT) + 1 + 3 * (SEEDED.max_tokens - 1) - 1


def test_replay_rings_are_folded_before_a_fork(tiny_model_path, reference):
    engine = _engine(tiny_model_path, replay_window=4)
    samples, _ = _samples(engine, "q", PROMPT, SEEDED.replace(max_tokens=11))
    assert [s.output_token_ids for s in samples] == _separate(
        reference, PROMPT, SEEDED.replace(max_tokens=11)
    )


def test_a_decode_engine_forks_transferred_state_on_admission(tiny_model_path, reference):
    prefill, decode = _engine(tiny_model_path), _engine(tiny_model_path)
    states: list[LayerState] = []
    first = prefill.add_request("t", PROMPT, SEEDED, export=states.append)
    samples = [first, *first.samples_to_fork]
    while prefill.has_unfinished_requests:
        prefill.step()
    assert [s.finish_reason for s in samples] == [HANDOFF] * 3, (
        "a prefill ends every sample on its first token"
    )
    assert decode.reserve_transfer("t", len(PROMPT), num_samples=3)
    for state in states:
        decode.write_transferred_state("t", state)
    starts = [SampleStart(s.output_token_ids[0]) for s in samples]
    admitted = decode.admit_transferred_samples("t", PROMPT, SEEDED, starts)
    blocks = decode.scheduler.blocks
    assert blocks.num_blocks - blocks.num_free_blocks == 7 + 2  # one prompt copy, two partial blocks
    while decode.has_unfinished_requests:
        decode.step()
    assert [r.output_token_ids for r in admitted] == _separate(reference, PROMPT, SEEDED)
    assert blocks.num_free_blocks == blocks.num_blocks
    assert decode.scheduler.slots.num_free_slots == decode.plan.num_slots


def test_a_decode_reservation_gives_back_the_room_of_samples_that_ended_on_their_first_token(
    tiny_model_path,
):
    prefill, decode = _engine(tiny_model_path), _engine(tiny_model_path, max_num_seqs=4)
    states: list[LayerState] = []
    first = prefill.add_request("e", PROMPT, SEEDED, export=states.append)
    samples = [first, *first.samples_to_fork]
    while prefill.has_unfinished_requests:
        prefill.step()
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode.reserve_transfer("big", len(PROMPT), num_samples=5)
    assert decode.reserve_transfer("e", len(PROMPT), num_samples=3)
    assert not decode.reserve_transfer("more", len(PROMPT), num_samples=2), "5 samples, 4 slots"
    assert decode.scheduler.num_seqs == 3 and decode.scheduler.slots.num_free_slots == 1
    for state in states:
        decode.write_transferred_state("e", state)
    starts = [SampleStart(s.output_token_ids[0], finished=i == 1) for i, s in enumerate(samples)]
    admitted = decode.admit_transferred_samples("e", PROMPT, SEEDED, starts)
    assert [r.sample_index for r in admitted] == [0, 2]
    assert decode.scheduler.num_seqs == 2 and decode.scheduler.slots.num_free_slots == 2
    decode.abort_request("e")  # every sample of it
    assert not decode.requests and decode.scheduler.blocks.num_free_blocks == decode.plan.num_blocks


def test_aborting_a_request_aborts_the_samples_waiting_for_its_prompt(tiny_model_path):
    engine = _engine(tiny_model_path)
    engine.add_request("a", PROMPT, SEEDED)
    assert len(engine.requests) == 3
    engine.abort_request("a")
    assert not engine.requests and not engine.has_unfinished_requests
    with pytest.raises(ValueError, match="one sample"):
        engine.add_request("b", PROMPT, SEEDED, output_token_ids=[1, 2])


def test_offline_llm_returns_n_outputs_and_best_of_keeps_the_most_likely(tiny_model_path, reference):
    llm = LLM(model=str(tiny_model_path), max_model_len=512, block_size=16)
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SEEDED)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == _separate(reference, PROMPT, SEEDED)

    ranked = SEEDED.replace(n=2, best_of=4)
    best = llm.generate(prompt_token_ids=[PROMPT], sampling_params=ranked)[0].outputs
    scored = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SEEDED.replace(n=4, logprobs=0))[
        0
    ].outputs
    expected = sorted(scored, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:2]
    assert [(c.index, c.token_ids) for c in best] == [(c.index, c.token_ids) for c in expected]
    assert all(c.logprobs is None for c in best), "logprobs drawn for the ranking are not returned"
