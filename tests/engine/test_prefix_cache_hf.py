"""The transformers oracle still holds with prefix caching on: requests that start from cached
prefixes (a second-sighting junction, a prompt end inside a block, the previous turn's end)
give transformers' greedy tokens and top-5 logprobs, judged like vLLM's check_logprobs_close."""

from __future__ import annotations

import random

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.tiny_model import make_tiny_model
from tests.engine.test_hf_parity import CHECKPOINTS
from tests.oracle import check_logprobs_close, engine_traces, hf_greedy

NUM_NEW_TOKENS = 8


def test_greedy_matches_transformers_with_prefix_hits(tiny_model_path):
    vocab = KimiLinearModelConfig.from_pretrained(tiny_model_path).vocab_size
    rng = random.Random(3)
    base = [rng.randrange(vocab) for _ in range(150)]
    llm = LLM(
        model=str(tiny_model_path),
        dtype="float32",
        enable_prefix_caching=True,
        prefix_unit=32,
        block_size=16,
        max_num_batched_tokens=48,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    warm = [base + [1, 2, 3], base + [4, 5]]  # the second sighting keeps the junction at 128
    first = [llm.generate(prompt_token_ids=[p], sampling_params=greedy)[0] for p in warm]
    prompts = [
        base + [6, 7, 8, 9],  # hits the junction (128)
        base[:140] + [10],  # hits the junction too
        warm[0] + [11],  # hits the first prompt's end (153, inside a block)
        warm[0] + list(first[0].outputs[0].token_ids) + [12, 13],  # the next turn: hits 160
    ]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    stats = llm.engine.prefix_cache_stats()
    assert stats.num_hit_tokens >= 128 + 128 + 153 + 160
    check_logprobs_close(hf_greedy(tiny_model_path, prompts, NUM_NEW_TOKENS), engine_traces(outputs))


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp(request.param), seed=len(request.param), **CHECKPOINTS[request.param]
    )


def test_hits_match_transformers_across_layer_layouts(checkpoint):
    """MLA first or last, conv kernels 2 to 4, with and without q LoRA: a hit inside a block (the
    previous prompt's end) and one at a junction give transformers' tokens."""
    vocab = KimiLinearModelConfig.from_pretrained(checkpoint).vocab_size
    rng = random.Random(5)
    base = [rng.randrange(vocab) for _ in range(100)]
    llm = LLM(
        model=str(checkpoint), dtype="float32", enable_prefix_caching=True, prefix_unit=16, block_size=16
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, logprobs=5)
    for warm in (base + [1], base + [2, 3]):
        llm.generate(prompt_token_ids=[warm], sampling_params=greedy)
    prompts = [base + [1, 4, 5], base + [6]]  # the first prompt's end (101), the junction (96)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    # the second warm-up hits the first's last unit before its end (96) too
    assert llm.engine.prefix_cache_stats().num_hit_tokens == 96 + 101 + 96
    check_logprobs_close(hf_greedy(checkpoint, prompts, NUM_NEW_TOKENS), engine_traces(outputs))
