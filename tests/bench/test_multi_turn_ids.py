"""The multi-turn-ids dataset: the same conversations as multi-turn, sent as token ids, each turn
carrying the previous prompt and the reply's ids exactly (against the fake server)."""

from __future__ import annotations

import pytest

from bench.api import chunk_token_ids
from bench.datasets import DatasetConfig, TokenConversation, build_dataset
from cli.main import main
from tests.bench.fake_server import FakeOpenAI, reply_token_ids, serving
from tests.bench.test_serve_fake import bench

SIZES = {"mt_num_sessions": 2, "mt_turns": 3, "mt_user_len": 9, "mt_output_len": 4, "seed": 5}
OPTIONS = ["--dataset", "multi-turn-ids", "--mt-num-sessions", "2", "--mt-turns", "3", "--mt-user-len", "9",
           "--mt-output-len", "4"]  # fmt: skip


def test_with_a_tokenizer_the_messages_are_the_multi_turn_texts_encoded(tokenizer):
    ids = build_dataset(DatasetConfig(name="multi-turn-ids", **SIZES), tokenizer)
    text = build_dataset(DatasetConfig(name="multi-turn", **SIZES), tokenizer)
    assert ids.num_requests == 6 and DatasetConfig(name="multi-turn-ids", **SIZES).fixed_num_requests() == 6
    for id_session, text_session in zip(ids.sessions, text.sessions, strict=True):
        for id_turn, text_turn in zip(id_session.turns, text_session.turns, strict=True):
            encoded = tuple(tokenizer.encode(text_turn.user_message, add_special_tokens=False))
            assert id_turn.user_message == encoded and id_turn.user_len == 9 == len(encoded)


def test_without_a_tokenizer_the_messages_are_seeded_random_ids():
    config = DatasetConfig(name="multi-turn-ids", vocab_size=50, **SIZES)
    first, again = build_dataset(config, None), build_dataset(config, None)
    assert first == again
    messages = [t.user_message for s in first.sessions for t in s.turns]
    assert all(isinstance(m, tuple) and len(m) == 9 and all(3 <= i < 50 for i in m) for m in messages)
    assert len(set(messages)) == len(messages)


def test_a_token_conversation_alternates_messages_and_replies():
    conversation = TokenConversation()
    conversation.ask((5, 6))
    with pytest.raises(RuntimeError, match="no reply yet"):
        conversation.ask((7,))
    conversation.answer((8,))
    with pytest.raises(RuntimeError, match="no turn is waiting"):
        conversation.answer((9,))
    conversation.ask((7,))
    assert conversation.prompt() == [5, 6, 8, 7]


def test_chunk_token_ids_reads_token_id_logprobs_and_refuses_text_tokens():
    event = {"choices": [{"text": "a", "logprobs": {"tokens": ["token_id:17", "token_id:4"]}}]}
    assert chunk_token_ids(event) == [17, 4]
    assert chunk_token_ids({"choices": [{"text": "a"}]}) == [] and chunk_token_ids({"choices": []}) == []
    with pytest.raises(ValueError, match="ignored return_tokens_as_token_ids"):
        chunk_token_ids({"choices": [{"text": "a", "logprobs": {"tokens": ["a"]}}]})


def test_each_turn_sends_the_previous_prompt_its_reply_ids_and_the_new_message(tmp_path):
    fake = FakeOpenAI()
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *OPTIONS)
    assert status == 0 and result.summary.completed == 6
    dataset = build_dataset(DatasetConfig(name="multi-turn-ids", **SIZES), None)
    by_prompt = {tuple(x.body["prompt"]): x.body for x in fake.received}
    assert len(by_prompt) == 6
    records = {(r.session_id, r.turn_index): r for r in result.records}
    for session in dataset.sessions:
        expected: list[int] = []
        for turn_index, turn in enumerate(session.turns):
            expected += list(turn.user_message)
            body = by_prompt[tuple(expected)]  # exactly the conversation so far, as ids
            assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
            assert records[(session.session_id, turn_index)].success
            expected += reply_token_ids(body)


def test_a_server_that_names_no_token_ids_fails_the_turn_and_the_session_stops(tmp_path):
    fake = FakeOpenAI()
    extra = ["--extra-body", '{"return_tokens_as_token_ids": false}']  # the fake then sends no logprobs
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *OPTIONS, *extra)
    assert status == 1 and len(fake.received) == 2  # each session's first turn only
    assert [r.success for r in result.records] == [False, False, False] * 2
    assert "named no token ids" in result.records[0].error
    assert result.records[1].error == "not sent: an earlier turn of session 0 failed"


def test_the_chat_endpoint_is_refused_for_token_ids(tmp_path, capsys, tokenizer_dir):
    with serving(FakeOpenAI()) as url:
        status = main(["bench", "serve", "--base-url", url, "--model", "fake", "--disable-tqdm",
                       "--result-file", str(tmp_path / "r.json"), "--endpoint", "chat",
                       "--tokenizer", str(tokenizer_dir), *OPTIONS])  # fmt: skip
    assert status == 2
    assert "only the completions endpoint takes" in capsys.readouterr().err
