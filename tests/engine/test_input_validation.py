"""Bad input raises a ValueError that names the problem, before anything runs."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine_config import EngineConfig


def test_empty_prompt_is_rejected(tiny_llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate(prompts=[""])


def test_token_outside_vocabulary_is_rejected(tiny_llm):
    vocab = tiny_llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab} is outside the vocabulary"):
        tiny_llm.generate(prompt_token_ids=[[1, 2, vocab]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate(prompt_token_ids=[[-1]])


def test_prompt_longer_than_context_is_rejected(tiny_llm):
    with pytest.raises(ValueError, match="prompt has 1,024 tokens; this model takes at most 1,023"):
        tiny_llm.generate(prompt_token_ids=[[5] * 1024])


def test_rejected_request_leaves_nothing_behind(tiny_llm):
    engine = tiny_llm.engine
    free_blocks = engine.scheduler.blocks.num_free_blocks
    with pytest.raises(ValueError):
        tiny_llm.generate(prompt_token_ids=[[3, 4, 5], []])
    assert not engine.has_unfinished_requests
    assert engine.scheduler.blocks.num_free_blocks == free_blocks
    assert engine.scheduler.slots.num_free_slots == engine.plan.num_slots


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_tokens", 0, "max_tokens must be at least 1"),
        ("temperature", -0.5, "temperature must be >= 0"),
        ("top_p", 0.0, "top_p must be in"),
        ("top_p", 1.5, "top_p must be in"),
        ("top_k", -3, "top_k must be"),
        ("min_p", 1.5, "min_p must be in"),
        ("presence_penalty", 3.0, "presence_penalty must be in"),
        ("frequency_penalty", -2.5, "frequency_penalty must be in"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("logprobs", 99, "logprobs must be in"),
        ("seed", -1, "seed must be in"),
        ("n", 0, "n must be in"),
        ("n", 17, "n must be in"),
        ("best_of", 17, "best_of must be in"),
        ("seed", 2**63, "seed must be in"),
    ],
)
def test_out_of_range_sampling_values_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_best_of_and_seeds_must_leave_room_for_every_sample():
    with pytest.raises(ValueError, match="best_of must be in"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="sample i draws with seed"):
        SamplingParams(n=3, seed=2**63 - 2)
    assert SamplingParams(n=3, seed=2**63 - 3).for_sample(2).seed == 2**63 - 1


def test_sampling_params_count_must_match_prompts(tiny_llm):
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        tiny_llm.generate(prompt_token_ids=[[1], [2]], sampling_params=[SamplingParams()])


def test_bad_engine_config_is_rejected(tiny_model_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model=str(tiny_model_path), dtype="float8")
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig(model=str(tiny_model_path), max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1,000 is too small"):
        LLM(model=str(tiny_model_path), kv_cache_memory_bytes=1000)
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        LLM(model=str(tiny_model_path / "nowhere"))
