"""`bench serve --dataset multi-turn-ids` against a live `splitserve up` (the tiny model): the
gateway's `token_id:N` logprobs give every reply's ids, and each turn's prompt is the previous
prompt + those ids + the new message (so it hits the previous prompt in the prefix cache)."""

from __future__ import annotations

import pytest

from bench.result import BenchmarkResult
from cli.main import main
from tests.bench.test_serve_live import API_KEY, gateway_url, model_path  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(600)


def test_each_turn_sends_the_whole_conversation_as_token_ids(gateway_url, tmp_path):  # noqa: F811
    result_file = tmp_path / "result.json"
    status = main(
        ["bench", "serve", "--base-url", gateway_url, "--model", "tiny", "--api-key", API_KEY,
         "--dataset", "multi-turn-ids", "--mt-num-sessions", "2", "--mt-turns", "3", "--mt-user-len", "20",
         "--mt-output-len", "4", "--max-concurrency", "2", "--disable-tqdm", "--result-file", str(result_file)]
    )  # fmt: skip
    result = BenchmarkResult.load(result_file)
    assert status == 0, [r.error for r in result.records if not r.success]
    by_turn: dict[int, set[int]] = {}
    for r in result.records:
        assert r.output_tokens == 4
        by_turn.setdefault(r.turn_index or 0, set()).add(r.prompt_tokens)
    # turn k: k messages of 20 ids and k - 1 replies of 4 ids, counted by the server
    assert by_turn == {0: {20}, 1: {44}, 2: {68}}
