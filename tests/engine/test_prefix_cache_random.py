"""A random mixed workload, caching on against off: prompts sharing prefixes of random lengths,
next turns, waves of concurrent requests, a KV budget small enough to evict and preempt, short
chunks; greedy tokens and logprobs agree (vLLM's check_logprobs_close) and every block is free
at the end."""

from __future__ import annotations

import random

from splitserve import LLM, SamplingParams
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model_config import KimiLinearModelConfig
from tests.oracle import check_logprobs_close, engine_traces


def _waves(vocab: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    bases = [[rng.randrange(vocab) for _ in range(rng.randint(40, 160))] for _ in range(3)]

    def prompt() -> list[int]:
        base = rng.choice(bases)
        return base[: rng.randint(1, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]

    return [[prompt() for _ in range(8)] for _ in range(3)]


def test_random_workload_caching_on_equals_off(tiny_model_path):
    config = KimiLinearModelConfig.from_pretrained(tiny_model_path)
    unit = CachePlan.specs(config, block_size=16, dtype="float32")
    common = dict(
        model=str(tiny_model_path),
        dtype="float32",
        block_size=16,
        prefix_unit=32,
        max_model_len=256,
        max_num_seqs=6,
        max_num_batched_tokens=40,
        kv_cache_memory_bytes=6 * unit.slot_bytes + 20 * unit.block_bytes,  # evicts and preempts
    )
    off = LLM(**common)
    on = LLM(**common, enable_prefix_caching=True, retention_interval=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)
    for wave in _waves(config.vocab_size, seed=4):
        want = off.generate(prompt_token_ids=wave, sampling_params=greedy)
        got = on.generate(prompt_token_ids=wave, sampling_params=greedy)
        check_logprobs_close(engine_traces(want), engine_traces(got))
        # the next turn of each conversation of the wave
        turns = [p + list(o.outputs[0].token_ids) + [7, 8] for p, o in zip(wave, want)]
        want = off.generate(prompt_token_ids=turns, sampling_params=greedy)
        got = on.generate(prompt_token_ids=turns, sampling_params=greedy)
        check_logprobs_close(engine_traces(want), engine_traces(got))
    stats = on.engine.prefix_cache_stats()
    assert stats.num_hit_tokens > 0 and stats.num_evictions > 0
    assert on.engine.scheduler.num_preemptions > 0
    blocks = on.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
