"""The batched sampler: greedy, cuts, penalties, min_tokens, raw logprobs and seeded draws."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    draw_seed,
    kept_candidates,
)
from splitserve.sampling_params import SamplingParams

VOCAB = 32
EOS = 5


def row(prompt=(), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output))


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw_histogram(logits_row: torch.Tensor, num_draws: int, **params) -> torch.Tensor:
    """Empirical distribution of one row drawn `num_draws` times in one unseeded batch."""
    sampler = Sampler(logits_row.shape[0], [], base_seed=1)
    out = sampler(logits_row.expand(num_draws, -1), [row(**params)] * num_draws)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[0]).float() / num_draws


def test_greedy_takes_argmax_in_any_dtype():
    logits = random_logits(6)
    sampler = Sampler(VOCAB, [EOS])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sampler(logits.to(dtype), [row(temperature=0.0)] * 6)
        assert out.token_ids == logits.to(dtype).float().argmax(dim=-1).tolist()
        assert out.logprobs is None


def test_temperature_below_vllms_epsilon_is_greedy():
    logits = random_logits(20)
    out = Sampler(VOCAB, [EOS])(logits, [row(temperature=1e-7, seed=3)] * 20)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_non_contiguous_logits_are_processed_like_contiguous_ones():
    logits = random_logits(4)
    strided = logits.t().contiguous().t()
    rows = [row(temperature=0.0, output=[int(logits[i].argmax())], repetition_penalty=3.0) for i in range(4)]
    sampler = Sampler(VOCAB, [EOS])
    assert sampler(strided, rows).token_ids == sampler(logits, rows).token_ids
    with pytest.raises(ValueError, match="contiguous"):
        apply_penalties(strided, [[0]] * 4, [[]] * 4, [2.0] * 4, [0.0] * 4, [0.0] * 4)


def test_greedy_does_not_modify_the_callers_logits():
    logits = random_logits(2)
    before = logits.clone()
    Sampler(VOCAB, [EOS])(logits, [row(temperature=0.0, repetition_penalty=2.0, output=[1]), row(top_k=3)])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = random_logits(40)
    out = Sampler(VOCAB, [EOS])(logits, [row(temperature=temperature, top_k=1)] * 40)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(40)
    out = Sampler(VOCAB, [EOS])(logits, [row(temperature=2.0, top_p=1e-6)] * 40)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_near_one_is_greedy():
    logits = random_logits(40)
    out = Sampler(VOCAB, [EOS])(logits, [row(temperature=2.0, min_p=0.999)] * 40)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_masked_tokens_are_never_drawn():
    logits = random_logits(1)[0]
    top3 = set(logits.topk(3).indices.tolist())
    hist = draw_histogram(logits, 4000, temperature=3.0, top_k=3)
    assert set(hist.nonzero().flatten().tolist()) == top3


def test_temperature_one_matches_softmax_over_many_seeds():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    sampler = Sampler(5, [], base_seed=3)
    rows = [row(seed=s) for s in range(20000)]
    tokens = torch.tensor(sampler(logits.expand(len(rows), -1), rows).token_ids)
    hist = torch.bincount(tokens, minlength=5).float() / len(rows)
    assert torch.allclose(hist, logits.softmax(-1), atol=0.015)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    hist = draw_histogram(logits, 20000, temperature=temperature)
    assert torch.allclose(hist, (logits / temperature).softmax(-1), atol=0.015)


def test_top_p_keeps_the_smallest_set_reaching_p_and_renormalizes():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    hist = draw_histogram(logits, 20000, top_p=0.7)  # 0.5 < 0.7 so token 1 stays; 0.8 >= 0.7 cuts token 2
    assert hist[2] == 0
    assert abs(hist[0].item() - 0.5 / 0.8) < 0.015


def test_min_p_cuts_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    hist = draw_histogram(logits, 20000, min_p=0.5)  # threshold 0.25
    assert hist[2] == 0
    assert abs(hist[0].item() - 0.5 / 0.8) < 0.015


def test_min_p_applies_before_top_p_as_in_vllm():
    # min_p=0.5 leaves {0.4, 0.3, 0.2} of [0.4, 0.3, 0.2, 0.1]; renormalized, 0.4/0.9 + 0.3/0.9 > 0.75,
    # so top_p=0.75 then cuts token 2 (applied to the raw distribution it would keep it).
    vals = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    keep = kept_candidates(vals, vals, [SamplingParams(min_p=0.5, top_p=0.75)])
    assert keep.tolist() == [[True, True, False, False]]


def test_ties_are_kept_or_cut_together():
    vals = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    assert kept_candidates(vals, vals, [SamplingParams(top_k=2)]).tolist() == [
        [True, True, True, True, False]
    ]
    weights = vals.softmax(-1)
    top_p = (weights[0, 0] + weights[0, 1] / 2).item()  # falls inside the tie
    keep = kept_candidates(vals, vals, [SamplingParams(top_p=top_p)])
    assert keep.tolist() == [[True, True, True, True, False]]


def test_top_p_over_a_wide_nucleus_grows_past_the_first_candidates():
    logits = torch.zeros(1, 4096)
    out = Sampler(4096, [])(logits.expand(2000, -1), [row(top_p=0.9)] * 2000)
    assert len(set(out.token_ids)) > 1000
    assert max(out.token_ids) < 4096


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 4.0], [2.0, -2.0, 1.0, -1.0, 4.0]])
    out = apply_penalties(logits, [[0], [1, 1]], [[1], [4]], [2.0, 4.0], [0.0, 0.0], [0.0, 0.0])
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 4.0], [2.0, -8.0, 1.0, -1.0, 1.0]]


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    out = apply_penalties(logits, [[0, 0, 0]], [[1, 1, 1, 2]], [1.0], [0.5], [0.25])
    assert out.tolist() == [[1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0]]


def test_penalties_ignore_token_ids_outside_the_vocabulary():
    logits = torch.tensor([[1.0, 1.0]])
    out = apply_penalties(logits, [[7]], [[2, 9]], [2.0], [1.0], [1.0])
    assert out.tolist() == [[1.0, 1.0]]


def test_penalties_change_greedy_choice_per_row_only():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * 2)
    rows = [row(temperature=0.0, output=[0], repetition_penalty=2.0), row(temperature=0.0, output=[0])]
    assert Sampler(4, [])(logits, rows).token_ids == [1, 0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 3.0, 5.0]])  # EOS=5 first, stop id 4 second
    sampler = Sampler(6, [EOS])
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[4])
    assert sampler(logits, [row(output=[1], **params)]).token_ids == [1]
    assert sampler(logits, [row(output=[1, 1], **params)]).token_ids == [EOS]
    # ignore_eos only stops stopping; it neither unmasks EOS before min_tokens nor masks it after
    assert sampler(logits, [row(output=[], ignore_eos=True, **params)]).token_ids == [1]
    assert sampler(logits, [row(temperature=0.0, ignore_eos=True)]).token_ids == [EOS]


def test_logprobs_are_raw_top_n_plus_the_sampled_token():
    logits = random_logits(3)
    raw = logits.log_softmax(-1)
    rows = [
        row(temperature=0.0, logprobs=3, min_tokens=1),  # EOS may be masked, logprobs stay raw
        row(temperature=0.7, top_k=2, logprobs=0, repetition_penalty=1.5, output=[0, 1]),
        row(temperature=1.0),
    ]
    out = Sampler(VOCAB, [int(logits[0].argmax())])(logits, rows)
    assert out.logprobs is not None and out.logprobs[2] is None
    first, second = out.logprobs[0], out.logprobs[1]
    assert first is not None and second is not None
    top3 = raw[0].topk(3).indices.tolist()
    assert list(first)[:3] == top3
    assert out.token_ids[0] not in top3[:1] and out.token_ids[0] in first
    assert len(first) == 3 + (out.token_ids[0] not in top3)
    assert list(second) == [out.token_ids[1]]
    for i, entry in ((0, first), (1, second)):
        for token, value in entry.items():
            assert value == pytest.approx(raw[i, token].item(), abs=1e-6)


def test_no_row_asking_for_logprobs_gives_none():
    out = Sampler(VOCAB, [EOS])(random_logits(2), [row(), row(temperature=0.0)])
    assert out.logprobs is None


SEEDED_CUT = dict(seed=1234, temperature=1.3, top_p=0.95, top_k=20, repetition_penalty=1.1)
SEEDED_WHOLE = dict(seed=1234, temperature=0.9, presence_penalty=0.5)  # races over the whole vocabulary


def seeded_draw(
    sampler: Sampler,
    logits: torch.Tensor,
    others: list[tuple[torch.Tensor, SamplingRow]],
    at: int,
    params: dict,
) -> int:
    target = row(prompt=[1, 2], output=[3] * 7, **params)
    pairs = list(others)
    pairs.insert(at, (logits, target))
    batch = torch.stack([p[0] for p in pairs])
    return sampler(batch, [p[1] for p in pairs]).token_ids[at]


@pytest.mark.parametrize("params", [SEEDED_CUT, SEEDED_WHOLE], ids=["cut", "whole"])
def test_seeded_row_ignores_batch_composition_position_and_sampler(params):
    logits = torch.zeros(VOCAB)  # flat: the draw alone decides the token
    others = [
        (random_logits(1, seed=5)[0], row(top_k=30)),
        (random_logits(1, seed=6)[0], row(temperature=0.0)),
        (random_logits(1, seed=7)[0], row(seed=9, min_p=0.1)),
        (random_logits(1, seed=8)[0], row(top_p=0.5, logprobs=2)),
        (random_logits(1, seed=9)[0], row(temperature=0.5)),
    ]
    alone = seeded_draw(Sampler(VOCAB, [EOS], base_seed=0), logits, [], 0, params)
    sampler = Sampler(VOCAB, [EOS], base_seed=0)
    for step in range(3):  # earlier calls do not matter either
        batch = others[: step + 3]
        for at in range(len(batch) + 1):
            assert seeded_draw(sampler, logits, batch, at, params) == alone
    assert seeded_draw(Sampler(VOCAB, [EOS], base_seed=99), logits, others[1:], 2, params) == alone


def test_seeded_draw_does_not_depend_on_how_many_candidates_were_examined():
    logits = torch.zeros(4096)
    logits[:100] = 10.0 + torch.linspace(0.0, 0.5, 100)  # a nucleus of ~90 tokens
    targets = [row(seed=s, top_p=0.9) for s in range(50)]
    alone = Sampler(4096, [])(logits.expand(50, -1), targets).token_ids  # K = 64, then 1024
    batch = torch.stack([logits] * 51)
    beside_top_k = Sampler(4096, [])(batch, [row(top_k=200), *targets]).token_ids[1:]  # K = 201
    assert beside_top_k == alone
    assert len(set(alone)) > 20 and max(alone) < 100


def test_seeded_noise_follows_token_ids_not_the_order_topk_gave_ties():
    vals = torch.zeros(1, 6)
    ids = torch.tensor([[3, 7, 1, 9, 0, 4]])
    perm = torch.tensor([4, 2, 5, 0, 3, 1])
    keep = torch.ones(1, 6, dtype=torch.bool)
    sampler = Sampler(VOCAB, [])
    for seed in range(20):
        seeds: list[int | None] = [draw_seed(seed, 0)]
        assert sampler._race(vals, ids, keep, seeds) == sampler._race(vals, ids[:, perm], keep, seeds)


def test_a_token_entering_the_nucleus_changes_a_seeded_draw_only_when_it_wins():
    """Float wobble across batch shapes can move the top-p boundary by one token (a real flake:
    a tiny model's near-flat distribution put the cumulative mass 2e-8 from top_p). Only a draw
    that the extra token wins may change."""
    logits_row = 0.01 * torch.arange(VOCAB, dtype=torch.float32)  # near-flat, the last id likeliest
    mass = logits_row.flip(0).softmax(0).cumsum(0).tolist()  # by rank
    logits = logits_row.expand(200, -1)
    narrow = [row(seed=s, top_p=(mass[9] + mass[10]) / 2) for s in range(200)]  # keeps ids 21..31
    wide = [row(seed=s, top_p=(mass[10] + mass[11]) / 2) for s in range(200)]  # and id 20, below all
    narrow_ids = Sampler(VOCAB, [])(logits, narrow).token_ids
    wide_ids = Sampler(VOCAB, [])(logits, wide).token_ids
    assert set(narrow_ids) == set(range(21, 32)) and set(wide_ids) == set(range(20, 32))
    changed = [(a, b) for a, b in zip(narrow_ids, wide_ids) if a != b]
    assert changed, "the token that entered should win some draws"
    assert all(b == 20 for _, b in changed)  # every other draw is untouched


def test_seeded_draws_differ_across_output_index():
    logits = torch.zeros(1, 1000)
    sampler = Sampler(1000, [])
    tokens = [sampler(logits, [row(seed=5, output=[0] * i)]).token_ids[0] for i in range(20)]
    assert len(set(tokens)) > 15


def test_draw_seed_is_a_fixed_64_bit_mix():
    assert draw_seed(0, 0) != draw_seed(0, 1) != draw_seed(1, 0)
    assert 0 <= draw_seed(2**63 - 1, 10**9) < 2**64
    assert draw_seed(42, 3) == draw_seed(42, 3)


def test_mixed_batch_of_greedy_and_sampled_rows():
    logits = random_logits(8)
    greedy_rows = [0, 3, 5]
    rows = [row(temperature=0.0) if i in greedy_rows else row(top_k=2, temperature=1.0) for i in range(8)]
    out = Sampler(VOCAB, [EOS])(logits, rows)
    top2 = logits.topk(2, dim=-1).indices
    for i, token in enumerate(out.token_ids):
        if i in greedy_rows:
            assert token == logits[i].argmax().item()
        else:
            assert token in top2[i].tolist()


def test_unseeded_draws_follow_base_seed():
    logits = torch.zeros(16, 1000)
    first = Sampler(1000, [], base_seed=4)(logits, [row()] * 16).token_ids
    again = Sampler(1000, [], base_seed=4)(logits, [row()] * 16).token_ids
    other = Sampler(1000, [], base_seed=5)(logits, [row()] * 16).token_ids
    assert first == again != other


def test_wrong_logits_shape_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(2, 48\).*\(2, 32\)"):
        Sampler(VOCAB, [EOS])(torch.zeros(2, 48), [row(), row()])


def test_empty_batch():
    assert Sampler(VOCAB, [EOS])(torch.zeros(0, VOCAB), []).token_ids == []


def test_logprob_values_are_finite_even_for_masked_tokens():
    logits = torch.tensor([[0.0, 0.0, 10.0]])
    out = Sampler(3, [2])(logits, [row(temperature=0.0, min_tokens=3, logprobs=1)])
    assert out.token_ids != [2]
    assert out.logprobs is not None and out.logprobs[0] is not None
    assert all(math.isfinite(v) for v in out.logprobs[0].values())
