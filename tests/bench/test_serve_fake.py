"""`splitserve bench serve` through `cli.main.main`, against a fake OpenAI server."""

from __future__ import annotations

import json
import socket

import pytest

from bench.datasets import DatasetConfig, build_dataset
from bench.result import BenchmarkResult
from cli.main import main
from tests.bench.fake_server import FakeOpenAI, prompt_tokens, reply_words, serving


def bench(url: str, result_file, *options: str) -> tuple[int, BenchmarkResult]:
    status = main(
        ["bench", "serve", "--base-url", url, "--model", "fake", "--seed", "5", "--disable-tqdm",
         "--result-file", str(result_file), *options]
    )  # fmt: skip
    return status, BenchmarkResult.load(result_file)


RANDOM_OPTIONS = ["--num-prompts", "12", "--random-input-len", "20", "--random-output-len", "6", "--random-range-ratio", "0.5"]  # fmt: skip


def test_every_request_is_recorded_with_usage_counts_and_failures_with_their_error(tmp_path, capsys):
    prompts = [r.prompt for r in build_dataset(
        DatasetConfig(num_prompts=12, random_input_len=20, random_output_len=6, random_range_ratio=0.5, seed=5), None
    ).requests]  # fmt: skip
    statuses = {prompts[2]: 500, prompts[7]: 400}
    fake = FakeOpenAI(
        fail=lambda body: statuses.get(tuple(body["prompt"])),
        error_event=lambda body: tuple(body["prompt"]) == prompts[9],
    )
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *RANDOM_OPTIONS)
    assert status == 1  # some requests failed
    records = result.records
    assert [r.index for r in records] == list(range(12))
    assert (result.summary.completed, result.summary.failed) == (9, 3)
    failed = {r.index: r.error for r in records if not r.success}
    assert set(failed) == {2, 7, 9}
    assert failed[2] == "HTTP 500: fake failure 500" and failed[7] == "HTTP 400: fake failure 400"
    assert failed[9] == "error event: fake mid-stream failure"
    by_prompt = {tuple(x.body["prompt"]): x.body for x in fake.received}
    for r, prompt in zip(records, prompts):
        body = by_prompt[prompt]
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == r.max_tokens
        if r.success:
            assert r.output_tokens == r.max_tokens and r.prompt_tokens == prompt_tokens(body)
            assert len(r.itl_s) == r.max_tokens - 1 and r.e2e_s >= r.ttft_s > 0
        else:
            assert r.ttft_s is None
    assert result.summary.total_output_tokens == sum(r.max_tokens for r in records if r.success)
    assert result.arguments["num_prompts"] == 12 and "api_key" not in result.arguments
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "Failed requests:" in out and "P99 ITL (ms):" in out


def test_the_json_keeps_arguments_summary_and_per_request_timings(tmp_path):
    with serving(FakeOpenAI()) as url:
        status, _ = bench(url, tmp_path / "r.json", *RANDOM_OPTIONS, "--goodput", "ttft:60000", "e2el:60000")
    assert status == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["arguments"]["request_rate"] == "inf" and data["arguments"]["goodput"] == [
        "ttft:60000",
        "e2el:60000",
    ]
    assert data["summary"]["completed"] == 12 and data["summary"]["slos_ms"] == {
        "ttft": 60000.0,
        "e2el": 60000.0,
    }
    assert data["summary"]["goodput_rps"] == pytest.approx(data["summary"]["request_throughput_rps"])
    keys = {
        "index",
        "start_s",
        "ttft_s",
        "itl_s",
        "e2e_s",
        "tpot_s",
        "prompt_tokens",
        "output_tokens",
        "success",
        "error",
    }
    assert len(data["requests"]) == 12 and all(keys <= set(r) for r in data["requests"])


def test_the_concurrency_cap_is_never_exceeded(tmp_path):
    fake = FakeOpenAI(gate_in_flight=3)  # holds requests until 3 are open: the cap becomes visible
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *RANDOM_OPTIONS, "--max-concurrency", "3")
    assert status == 0 and result.summary.completed == 12
    assert fake.max_in_flight == 3


def test_a_finite_request_rate_still_sends_every_request(tmp_path):
    with serving(FakeOpenAI()) as url:
        status, result = bench(
            url, tmp_path / "r.json", *RANDOM_OPTIONS, "--request-rate", "500", "--burstiness", "0.5"
        )
    assert status == 0 and result.summary.completed == 12
    assert result.arguments["request_rate"] == 500.0


def test_without_usage_tokens_are_the_chunk_count_and_the_datasets_prompt_length(tmp_path):
    fake = FakeOpenAI(send_usage=False)
    with serving(fake) as url:
        _, result = bench(url, tmp_path / "r.json", *RANDOM_OPTIONS)
    assert all(r.output_tokens == r.max_tokens for r in result.records)
    sent_lengths = sorted(len(x.body["prompt"]) for x in fake.received)
    assert sorted(r.prompt_tokens for r in result.records) == sent_lengths


def test_shared_prefix_over_chat_sends_the_system_prompt_as_a_system_message(tmp_path, tokenizer_dir):
    fake = FakeOpenAI()
    options = ["--dataset", "shared-prefix", "--endpoint", "chat", "--tokenizer", str(tokenizer_dir),
               "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "30",
               "--gsp-question-len", "5", "--gsp-output-len", "4"]  # fmt: skip
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *options)
    assert status == 0 and result.summary.completed == 6
    systems = [x.body["messages"][0] for x in fake.received]
    assert all(m["role"] == "system" for m in systems) and len({m["content"] for m in systems}) == 2
    assert all(x.body["messages"][1]["role"] == "user" for x in fake.received)
    assert all(r.output_tokens == 4 for r in result.records)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_multi_turn_sends_the_servers_replies_back_in_later_turns(
    endpoint, tmp_path, tokenizer_dir, tokenizer
):
    fake = FakeOpenAI()
    options = ["--dataset", "multi-turn", "--endpoint", endpoint, "--tokenizer", str(tokenizer_dir),
               "--mt-num-sessions", "3", "--mt-turns", "3", "--mt-user-len", "7", "--mt-output-len", "4"]  # fmt: skip
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *options)
    assert status == 0 and result.summary.completed == 9
    assert [(r.session_id, r.turn_index) for r in result.records] == [
        (s, t) for s in range(3) for t in range(3)
    ]
    by_prompt = {json.dumps(x.body.get("prompt", x.body.get("messages"))): x for x in fake.received}
    dataset = build_dataset(
        DatasetConfig(
            name="multi-turn", mt_num_sessions=3, mt_turns=3, mt_user_len=7, mt_output_len=4, seed=5
        ),
        tokenizer,
    )
    for session in dataset.sessions:
        history: list[dict[str, str]] = []
        for turn in session.turns:
            history.append({"role": "user", "content": turn.user_message})
            sent = history if endpoint == "chat" else "".join(m["content"] for m in history)
            received = by_prompt[json.dumps(sent)]  # the exact conversation so far was sent
            assert received.reply == "".join(reply_words(received.body))
            history.append({"role": "assistant", "content": received.reply})


def test_later_turns_of_a_session_whose_turn_failed_are_not_sent(tmp_path, tokenizer_dir):
    fake = FakeOpenAI(fail=lambda body: 500 if len(body["messages"]) == 3 else None)  # every second turn
    options = ["--dataset", "multi-turn", "--endpoint", "chat", "--tokenizer", str(tokenizer_dir),
               "--mt-num-sessions", "2", "--mt-turns", "3", "--mt-user-len", "5", "--mt-output-len", "2"]  # fmt: skip
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *options)
    assert status == 1 and len(fake.received) == 4
    assert [r.success for r in result.records] == [True, False, False] * 2
    assert result.records[2].error == "not sent: an earlier turn of session 0 failed"


def test_an_unreachable_server_fails_every_request_without_crashing(tmp_path):
    with socket.socket() as s:  # a port nothing listens on once this closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    status, result = bench(
        f"http://127.0.0.1:{port}", tmp_path / "r.json", "--num-prompts", "3", "--random-input-len", "4"
    )
    assert status == 1 and result.summary.failed == 3
    assert all(r.error.startswith("ConnectError") for r in result.records)


def test_bad_options_exit_2_with_the_reason(tmp_path, capsys):
    assert (
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--goodput", "itl:5"])
        == 2
    )
    assert "goodput SLO metric 'itl' is unknown" in capsys.readouterr().err
    assert (
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--endpoint", "chat"])
        == 2
    )
    assert "--endpoint chat sends text, which needs a tokenizer" in capsys.readouterr().err


def test_a_think_time_pauses_each_session_between_a_reply_and_its_next_turn(tmp_path):
    fake = FakeOpenAI()
    options = ["--dataset", "multi-turn-ids", "--mt-num-sessions", "2", "--mt-turns", "3",
               "--mt-user-len", "5", "--mt-output-len", "2", "--think-time-s", "0.2"]  # fmt: skip
    with serving(fake) as url:
        status, result = bench(url, tmp_path / "r.json", *options)
    assert status == 0 and result.summary.completed == 6
    assert result.arguments["think_time_s"] == 0.2
    by_turn = {(r.session_id, r.turn_index): r for r in result.records}
    for session in range(2):
        for turn in (1, 2):
            before, after = by_turn[(session, turn - 1)], by_turn[(session, turn)]
            assert before.e2e_s is not None
            assert after.start_s - (before.start_s + before.e2e_s) >= 0.2  # a sleep never ends early
