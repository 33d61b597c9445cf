"""Each dataset is reproducible from its seed and keeps the lengths and structure it promises."""

from __future__ import annotations

import dataclasses

import pytest

from bench.datasets import Conversation, DatasetConfig, build_dataset

RANDOM = DatasetConfig(
    name="random", num_prompts=40, random_input_len=60, random_output_len=20, random_range_ratio=0.5, seed=7
)
SHARED = DatasetConfig(
    name="shared-prefix",
    gsp_num_groups=3,
    gsp_prompts_per_group=4,
    gsp_system_prompt_len=50,
    gsp_question_len=9,
    gsp_output_len=6,
    seed=7,
)
MULTI = DatasetConfig(
    name="multi-turn", mt_num_sessions=3, mt_turns=4, mt_user_len=12, mt_output_len=5, seed=7
)


def count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("config", "with_tokenizer"),
    [
        (RANDOM, True),
        (RANDOM, False),
        (SHARED, True),
        (SHARED, False),
        (MULTI, True),
    ],  # multi-turn is text only
    ids=["random-text", "random-ids", "shared-prefix-text", "shared-prefix-ids", "multi-turn-text"],
)
def test_the_same_seed_gives_the_same_dataset_and_another_seed_another(config, with_tokenizer, tokenizer):
    tok = tokenizer if with_tokenizer else None
    first = build_dataset(config, tok)
    assert build_dataset(config, tok) == first
    assert build_dataset(dataclasses.replace(config, seed=8), tok) != first


def test_random_lengths_stay_in_range_and_text_prompts_measure_what_they_say(tokenizer):
    dataset = build_dataset(RANDOM, tokenizer)
    assert len(dataset.requests) == 40
    input_lens = [r.prompt_len for r in dataset.requests]
    output_lens = [r.output_len for r in dataset.requests]
    assert all(30 <= n <= 90 for n in input_lens) and len(set(input_lens)) > 10
    assert all(10 <= n <= 30 for n in output_lens) and len(set(output_lens)) > 5
    for r in dataset.requests:
        assert isinstance(r.prompt, str) and count(tokenizer, r.prompt) == r.prompt_len


def test_a_zero_range_ratio_gives_exact_lengths_and_token_ids_avoid_the_low_ids():
    config = dataclasses.replace(RANDOM, random_range_ratio=0.0, vocab_size=50)
    dataset = build_dataset(config, None)
    for r in dataset.requests:
        assert isinstance(r.prompt, tuple) and len(r.prompt) == r.prompt_len == 60 and r.output_len == 20
        assert all(3 <= t < 50 for t in r.prompt)


def test_a_random_prefix_is_shared_by_every_prompt_on_top_of_its_input_length(tokenizer):
    config = dataclasses.replace(RANDOM, random_prefix_len=25, random_range_ratio=0.0)
    ids = build_dataset(config, None).requests
    assert len({r.prompt[:25] for r in ids}) == 1 and len({r.prompt for r in ids}) == len(ids)
    assert all(r.prompt_len == 85 for r in ids)
    texts = build_dataset(config, tokenizer).requests
    prefix = texts[0].system_prompt
    assert count(tokenizer, prefix) == 25
    for r in texts:
        assert r.system_prompt == prefix and r.prompt.startswith(prefix) and r.prompt_len == 85
        assert r.messages() == [
            {"role": "system", "content": prefix},
            {"role": "user", "content": r.prompt[len(prefix) :]},
        ]


@pytest.mark.parametrize("with_tokenizer", [True, False], ids=["text", "token-ids"])
def test_shared_prefix_groups_share_exactly_their_system_prompt(with_tokenizer, tokenizer):
    dataset = build_dataset(SHARED, tokenizer if with_tokenizer else None)
    assert len(dataset.requests) == 12
    groups: dict[int, list] = {}
    for r in dataset.requests:
        groups.setdefault(r.group_id, []).append(r)
        assert r.prompt_len == 59 and r.output_len == 6
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 4 for g in groups.values())
    if with_tokenizer:
        systems = {gid: {r.system_prompt for r in g} for gid, g in groups.items()}
        assert all(len(s) == 1 for s in systems.values())
        assert len({next(iter(s)) for s in systems.values()}) == 3
        for r in dataset.requests:
            assert r.prompt.startswith(r.system_prompt) and count(tokenizer, r.system_prompt) == 50
            assert r.messages()[0] == {"role": "system", "content": r.system_prompt}
    else:
        prefixes = {gid: {r.prompt[:50] for r in g} for gid, g in groups.items()}
        assert all(len(p) == 1 for p in prefixes.values())
        assert len({next(iter(p)) for p in prefixes.values()}) == 3
    assert len({r.prompt for r in dataset.requests}) == 12  # every question differs


def test_shared_prefix_order_is_shuffled_by_the_seed(tokenizer):
    groups = [r.group_id for r in build_dataset(SHARED, tokenizer).requests]
    assert groups != sorted(groups)


def test_multi_turn_sessions_have_their_turns_and_lengths(tokenizer):
    dataset = build_dataset(MULTI, tokenizer)
    assert dataset.is_multi_turn and dataset.num_requests == 12
    assert [s.session_id for s in dataset.sessions] == [0, 1, 2]
    for session in dataset.sessions:
        assert len(session.turns) == 4
        for turn in session.turns:
            assert turn.user_len == 12 == count(tokenizer, turn.user_message) and turn.output_len == 5


def test_multi_turn_turn_k_plus_1_carries_turn_k_prompt_and_reply():
    conversation = Conversation()
    conversation.ask(" hello there")
    first_text, first_messages = conversation.text(), conversation.messages()
    conversation.answer(" general kenobi")
    conversation.ask(" you are a bold one")
    assert conversation.text() == first_text + " general kenobi" + " you are a bold one"
    assert conversation.messages()[: len(first_messages)] == first_messages
    assert conversation.messages()[1:] == [
        {"role": "assistant", "content": " general kenobi"},
        {"role": "user", "content": " you are a bold one"},
    ]
    with pytest.raises(RuntimeError, match="no reply yet"):
        conversation.ask(" again")


def test_multi_turn_without_a_tokenizer_says_how_to_give_one():
    with pytest.raises(ValueError, match="needs a tokenizer: pass --tokenizer PATH"):
        build_dataset(MULTI, None)


def test_options_that_make_no_sense_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"random_range_ratio must be in \[0, 1\)"):
        DatasetConfig(random_range_ratio=1.5)
    with pytest.raises(ValueError, match="sends 12 requests"):
        dataclasses.replace(SHARED, num_prompts=5)
    with pytest.raises(ValueError, match="unknown dataset 'sharegpt'"):
        DatasetConfig(name="sharegpt")
