"""Seeded noise drawn ahead of the logits (`Sampler.prepare`, on CUDA by default) is exactly the noise
drawn on demand: the same values, so the same tokens for seeded, unseeded and greedy rows alike."""

from __future__ import annotations

import torch

from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.engine.seeded_noise import SeededNoise
from splitserve.sampling_params import SamplingParams

VOCAB = 300


def test_prepared_noise_equals_noise_drawn_on_demand():
    ahead = SeededNoise(VOCAB, torch.device("cpu"), ahead=True)
    on_demand = SeededNoise(VOCAB, torch.device("cpu"))
    ahead.prepare([11, 7, 11, 5])
    assert sorted(ahead._prepared) == [5, 7, 11]  # drawn ahead, once per seed: what `draw` serves next
    for seeds in ([11, 7, 5], [5, 11], [7]):
        assert torch.equal(ahead.draw(seeds), on_demand.draw(seeds))
    ahead.clear()
    assert torch.equal(ahead.draw([3, 11]), on_demand.draw([3, 11]))  # nothing prepared: drawn now


def test_cpu_draws_nothing_ahead_by_default():
    noise = SeededNoise(VOCAB, torch.device("cpu"))
    noise.prepare([1, 2])
    assert not noise.ahead and noise._prepared == {}


def _rows() -> list[SamplingRow]:
    kinds = [
        SamplingParams(temperature=0.8, seed=1),  # seeded, whole vocabulary
        SamplingParams(temperature=0.7, top_k=20, seed=2),  # seeded, cut
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, seed=3),
        SamplingParams(temperature=0.9),  # unseeded
        SamplingParams(temperature=0),  # greedy
        SamplingParams(temperature=1.1, top_k=5, seed=1),  # same seed as row 0, another output index
    ]
    return [SamplingRow(p, [4, 5, 6], list(range(i))) for i, p in enumerate(kinds)]


def test_sampler_tokens_are_the_same_with_noise_prepared_ahead():
    gen = torch.Generator().manual_seed(0)
    rows = _rows()
    for step in range(5):
        logits = torch.randn(len(rows), VOCAB, generator=gen) * 3
        plain = Sampler(VOCAB, [0], base_seed=step)(logits, rows)
        sampler = Sampler(VOCAB, [0], base_seed=step, noise_ahead=True)
        sampler.prepare(rows)
        assert sampler._seeded_noise._prepared  # the seeded rows' noise was drawn before the call
        prepared = sampler(logits, rows)
        assert prepared.token_ids == plain.token_ids, step
        assert not sampler._seeded_noise._prepared  # used once
