"""A seeded request draws the same tokens whatever shares its batch; sampling knobs take effect."""

from __future__ import annotations

from splitserve import SamplingParams

PROMPT = [11, 42, 7, 99, 3, 250, 18]


def _seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True, **kw)


def test_seeded_tokens_do_not_depend_on_batch_composition(tiny_llm):
    alone = tiny_llm.generate(prompt_token_ids=[PROMPT], sampling_params=_seeded(1234))[0]
    others = [[5] * 40, [17, 18, 19], list(range(3, 90))]
    crowd = tiny_llm.generate(
        prompt_token_ids=[others[0], PROMPT, others[1], others[2]],
        sampling_params=[_seeded(1), _seeded(1234), SamplingParams(temperature=0, max_tokens=30), _seeded(9)],
    )[1]
    assert crowd.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 24


def test_different_seeds_give_different_tokens(tiny_llm):
    a, b = tiny_llm.generate(prompt_token_ids=[PROMPT, PROMPT], sampling_params=[_seeded(1), _seeded(2)])
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_unseeded_sampling_is_not_greedy(tiny_llm):
    greedy = tiny_llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    )[0]
    sampled = tiny_llm.generate(
        prompt_token_ids=[PROMPT] * 4,
        sampling_params=SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True),
    )
    assert any(s.outputs[0].token_ids != greedy.outputs[0].token_ids for s in sampled)


def test_top_k_one_equals_greedy(tiny_llm):
    greedy = tiny_llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    )[0]
    top1 = tiny_llm.generate(
        prompt_token_ids=[PROMPT],
        sampling_params=SamplingParams(temperature=1.0, top_k=1, seed=5, max_tokens=16, ignore_eos=True),
    )[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_logprobs_hold_top_n_and_the_sampled_token(tiny_llm):
    out = tiny_llm.generate(prompt_token_ids=[PROMPT], sampling_params=_seeded(3, logprobs=2))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        assert 2 <= len(entry) <= 3
        assert all(lp <= 0.0 for lp in entry.values())
