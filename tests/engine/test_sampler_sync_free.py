"""The sync-free sampler (CUDA's default): the tokens of the sampler that grows its candidates, and
nothing read back to the host inside a call, checked with the meta device standing in for CUDA
(tests/engine/host_sync_guard.py)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.sampler import Sampler, SamplingRow
from splitserve.sampling_params import SamplingParams
from tests.engine.host_sync_guard import DEVICE, HostSyncError, no_host_sync

VOCAB = 4096
EOS = 5

CUTS = [
    dict(top_p=0.9),
    dict(top_p=0.99, temperature=0.7),
    dict(top_k=7),
    dict(top_k=300, temperature=1.3),
    dict(min_p=0.05),
    dict(min_p=0.001, temperature=2.0),
    dict(top_k=50, top_p=0.8),
    dict(top_k=20, min_p=0.1, top_p=0.95),
    dict(min_p=0.02, top_p=0.97),
    dict(temperature=0.8),
]


def _rows(seeded: bool) -> list[SamplingRow]:
    rows = []
    for i in range(60):
        kw = dict(CUTS[i % len(CUTS)])
        if seeded:
            kw["seed"] = 1000 + i
        rows.append(
            SamplingRow(SamplingParams(logprobs=2 if i % 3 == 0 else None, **kw), [1, 2], [3] * (i % 4))
        )
    return rows


def _logits(seed: int, ties: bool) -> torch.Tensor:
    logits = torch.randn(60, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.5
    if ties:  # coarse values: many tokens tie at every cut
        logits = (logits * 2).round() / 2
    return logits


@pytest.mark.parametrize("ties", [False, True])
def test_sync_free_draws_the_tokens_of_the_growing_candidates(ties):
    rows = _rows(seeded=True)
    for step in range(4):
        logits = _logits(step, ties)
        growing = Sampler(VOCAB, [EOS], sync_free=False)(logits, rows)
        sync_free = Sampler(VOCAB, [EOS], sync_free=True)(logits, rows)
        assert sync_free.token_ids == growing.token_ids, step
        assert sync_free.logprobs == growing.logprobs, step


def test_sync_free_cuts_hold_for_unseeded_rows():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    sampler = Sampler(VOCAB, [], sync_free=True, base_seed=2)
    top5 = set(logits.topk(5).indices.tolist())
    drawn = sampler(logits.expand(3000, -1), [SamplingRow(SamplingParams(top_k=5), [], [])] * 3000).token_ids
    assert set(drawn) == top5
    probs = logits.softmax(-1)
    nucleus = set(
        probs.sort(descending=True)
        .indices[: int((probs.sort(descending=True).values.cumsum(0) < 0.5).sum()) + 1]
        .tolist()
    )
    drawn = sampler(
        logits.expand(3000, -1), [SamplingRow(SamplingParams(top_p=0.5), [], [])] * 3000
    ).token_ids
    assert set(drawn) <= nucleus and len(set(drawn)) > 1


def _every_kind_of_row() -> list[SamplingRow]:
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.9, seed=4),
        SamplingParams(temperature=0.9),
        SamplingParams(top_p=0.9, seed=5),
        SamplingParams(top_k=20, min_p=0.1),
        SamplingParams(top_p=0.8, top_k=40, seed=6, logprobs=1),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[9]),
    ]
    return [SamplingRow(p, [1, 2, 3], [7, 8], num_pending=1) for p in kinds]


def test_a_sync_free_call_reads_nothing_back_inside_it():
    rows = _every_kind_of_row()
    sampler = Sampler(VOCAB, [EOS], device=DEVICE)
    assert sampler.sync_free is False  # only CUDA defaults to it
    sampler = Sampler(VOCAB, [EOS], device=DEVICE, sync_free=True, noise_ahead=True)
    with torch.inference_mode():
        logits = torch.empty(len(rows), VOCAB, device=DEVICE)
        sampler.prepare(rows)  # before the step's forward: the seeded noise drawn and sent
        with no_host_sync() as guard:
            out = sampler(logits, rows)
    assert out.sampled.shape == (len(rows),) and out.sampled.device == DEVICE
    assert guard.device_to_host == 4  # the ids and the three logprob tensors, queued, not waited for
    assert guard.host_to_device > 0  # row indices and parameters, each without a stream sync


def test_the_growing_sampler_would_read_back():
    rows = [SamplingRow(SamplingParams(top_p=0.9, seed=1), [], [])]
    sampler = Sampler(VOCAB, [EOS], device=DEVICE, sync_free=False)
    with torch.inference_mode(), pytest.raises(HostSyncError), no_host_sync():
        sampler(torch.empty(1, VOCAB, device=DEVICE), rows)
