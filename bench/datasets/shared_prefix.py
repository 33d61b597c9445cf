"""The shared-prefix dataset (SGLang's generated-shared-prefix): groups of prompts that share a
long system prompt, each with its own question."""

from __future__ import annotations

import random

from bench.datasets.base import BenchRequest, Dataset
from bench.datasets.config import DatasetConfig
from bench.datasets.prompts import PromptFactory
from bench.tokenizer import BenchTokenizer


def build_shared_prefix(config: DatasetConfig, tokenizer: BenchTokenizer | None) -> Dataset:
    """`gsp_num_groups * gsp_prompts_per_group` requests in an order shuffled by the seed.

    Every prompt of a group starts with the group's system prompt (`gsp_system_prompt_len`
    tokens, the same text or ids), followed by a question of `gsp_question_len` tokens.
    """
    rng = random.Random(config.seed)
    factory = PromptFactory(tokenizer, rng, config.vocab_size)
    requests = []
    for group_id in range(config.gsp_num_groups):
        system, _ = factory.prompt(config.gsp_system_prompt_len)
        for _ in range(config.gsp_prompts_per_group):
            question, _ = factory.prompt(config.gsp_question_len)
            prompt, prompt_len = factory.join(system, question)
            requests.append(
                BenchRequest(
                    prompt,
                    prompt_len,
                    config.gsp_output_len,
                    system_prompt=system if isinstance(system, str) else "",
                    group_id=group_id,
                )
            )
    rng.shuffle(requests)
    return Dataset(config.name, requests=tuple(requests))
