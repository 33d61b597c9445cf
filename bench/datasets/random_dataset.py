"""The random dataset: prompts of random tokens with lengths uniform around the asked ones."""

from __future__ import annotations

import random

from bench.datasets.base import BenchRequest, Dataset
from bench.datasets.config import DEFAULT_NUM_PROMPTS, DatasetConfig
from bench.datasets.prompts import PromptFactory, uniform_length
from bench.tokenizer import BenchTokenizer


def build_random(config: DatasetConfig, tokenizer: BenchTokenizer | None) -> Dataset:
    """`num_prompts` requests; input and output lengths uniform in [L(1-r), L(1+r)].

    With `random_prefix_len` every prompt starts with the same random prefix of that many
    tokens, on top of its own input length (as vLLM's `--random-prefix-len`).
    """
    rng = random.Random(config.seed)
    factory = PromptFactory(tokenizer, rng, config.vocab_size)
    num_prompts = config.num_prompts or DEFAULT_NUM_PROMPTS
    ratio = config.random_range_ratio
    input_lens = [uniform_length(rng, config.random_input_len, ratio) for _ in range(num_prompts)]
    output_lens = [uniform_length(rng, config.random_output_len, ratio) for _ in range(num_prompts)]
    prefix_ids = factory.token_ids(config.random_prefix_len)
    prefix_text = tokenizer.decode(prefix_ids) if tokenizer is not None and prefix_ids else ""
    requests = []
    for input_len, output_len in zip(input_lens, output_lens):
        num_tokens = config.random_prefix_len + input_len
        ids = prefix_ids + factory.token_ids(input_len)
        if tokenizer is None:
            requests.append(BenchRequest(tuple(ids), num_tokens, output_len))
            continue
        text, prompt_len = factory.fit_text(ids, num_tokens)
        system_prompt = prefix_text if prefix_text and text.startswith(prefix_text) else ""
        requests.append(BenchRequest(text, prompt_len, output_len, system_prompt=system_prompt))
    return Dataset(config.name, requests=tuple(requests))
