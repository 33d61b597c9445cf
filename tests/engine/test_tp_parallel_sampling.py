"""`n` samples from one prefill on a tensor-parallel engine (2 rank processes, gloo): every rank makes
the same samples of the forwarded request and forks them at the same step from the broadcast first
tokens, so each seeded sample equals a separate request seeded seed + i on the same engine, the
prompt is computed once, and the ranks stay in step (a rank that forked differently would meet the
next collective with another batch) through prefix caching, ReplaySSM rings, the no-free-slot
fallback, aborts of samples still waiting for their prompt, and the offline `LLM`'s n and best_of."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine_config import EngineConfig
from splitserve.sampling_params import sample_request_id
from tests.engine.test_parallel_sampling import PROMPT, SEEDED, _samples, _separate


def _tp_engine(path, **kwargs: object) -> LLMEngine:
    config = dict(model=str(path), max_model_len=512, block_size=16, tensor_parallel_size=2)
    config.update(kwargs)
    return LLMEngine(EngineConfig(**config))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_path) -> Iterator[LLMEngine]:
    engine = _tp_engine(tiny_model_path)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "extra",
    [{"enable_prefix_caching": True}, {"replay_window": 4}, {"max_num_seqs": 2}],
    ids=["prefix-caching", "replay-ssm", "no-free-slot"],
)
def test_seeded_samples_on_two_ranks_equal_separate_requests(tiny_model_path, two_ranks, extra):
    engine = _tp_engine(tiny_model_path, **extra)
    try:
        samples, num_computed = _samples(engine, "r", PROMPT, SEEDED)
        assert [s.request_id for s in samples] == [sample_request_id("r", i) for i in range(3)]
        assert [s.output_token_ids for s in samples] == _separate(two_ranks, PROMPT, SEEDED)
        assert len({tuple(s.output_token_ids) for s in samples}) == 3, "seeds 41, 42, 43 draw differently"
        prompt_computed = 2 if "max_num_seqs" in extra else 1  # sample 2 waited for a slot, then computed it
        tail = 3 * (SEEDED.max_tokens - 1) - (prompt_computed - 1)
        assert num_computed == prompt_computed * len(PROMPT) + (prompt_computed - 1) + tail
        assert engine.scheduler.blocks.num_free_blocks == engine.plan.num_blocks
        # the ranks are still in step: a request after the samples gives the same tokens again
        again, _ = _samples(engine, "again", PROMPT, SEEDED)
        assert [s.output_token_ids for s in again] == [s.output_token_ids for s in samples]
    finally:
        engine.shutdown()


def test_aborted_samples_leave_the_ranks_in_step(two_ranks):
    first = two_ranks.add_request("a", PROMPT, SEEDED)
    assert len(two_ranks.requests) == 3
    two_ranks.abort_request(first.samples_to_fork[0].request_id)  # one sample still waiting
    two_ranks.step()  # the prompt, the first tokens, one fork
    assert sorted(two_ranks.requests) == [sample_request_id("a", 0), sample_request_id("a", 2)]
    two_ranks.abort_request("a")  # the rest
    assert not two_ranks.has_unfinished_requests
    with pytest.raises(ValueError, match="one sample"):  # refused alike on every rank
        two_ranks.add_request("b", PROMPT, SEEDED, output_token_ids=[1, 2])
    samples, _ = _samples(two_ranks, "c", PROMPT, SEEDED)
    assert [s.output_token_ids for s in samples] == _separate(two_ranks, PROMPT, SEEDED)


def test_offline_llm_on_two_ranks_returns_n_samples_and_the_best_of(tiny_model_path):
    llm = LLM(model=str(tiny_model_path), max_model_len=512, block_size=16, tensor_parallel_size=2)
    try:
        out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SEEDED)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == _separate(llm.engine, PROMPT, SEEDED)
        ranked = SEEDED.replace(n=2, best_of=4)
        best = llm.generate(prompt_token_ids=[PROMPT], sampling_params=ranked)[0].outputs
        scored = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SEEDED.replace(n=4, logprobs=0))
        expected = sorted(scored[0].outputs, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:2]
        assert [(c.index, c.token_ids) for c in best] == [(c.index, c.token_ids) for c in expected]
    finally:
        llm.shutdown()
