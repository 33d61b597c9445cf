"""The prompt's fast path (a list of token ids checked once, in pydantic-core) takes what the general
path takes and refuses what it refuses, with the same words; the schema still names four shapes."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from frontend.prompt_shape import INT32_MAX, PromptShapes, _general_prompt, _plain_token_ids, valid_prompt
from frontend.protocol import CompletionRequest
from frontend.request_checks import check_raw_request, lone_surrogate_path

LONG_IDS = [(i * 7919) % 160_000 for i in range(32_000)]

ACCEPTED: list[Any] = [
    "hi",
    ["a", "b"],
    [0, 5, INT32_MAX],
    [[1, 2], [3]],
    [5.0, 6],  # integral floats: the general path makes them ints
    [[1], [2.0, 3]],
    LONG_IDS,
]

REFUSED: list[tuple[Any, str]] = [
    ("", "must not be empty"),
    ([], "must not be empty"),
    ([[]], "must not be empty"),
    ([[1], []], "must not be empty"),
    ([1, True], "prompt must be a string"),
    ([1, 1.5], "prompt must be a string"),
    ([1, "a"], "prompt must be a string"),
    ([1, None], "prompt must be a string"),
    ([[1], "a"], "prompt must be a string"),
    ([[1], True], "prompt must be a string"),  # a truthy non-list after a list (schemathesis found it)
    ([[1], 7], "prompt must be a string"),
    ([[[]], True], "prompt must be a string"),
    (["a", [1, 2]], "prompt must be a string"),
    ({"text": "hi"}, "prompt must be a string"),
    (5, "prompt must be a string"),
    ([1, -1], "prompt token id -1 is out of range"),
    ([1, INT32_MAX + 1], f"prompt token id {INT32_MAX + 1} is out of range"),
    ([1, 10**30], f"prompt token id {10**30} is out of range"),
    ([[1], [2, INT32_MAX + 1]], f"prompt token id {INT32_MAX + 1} is out of range"),
    ([*LONG_IDS, -3], "prompt token id -3 is out of range"),
]


@pytest.mark.parametrize("prompt", ACCEPTED, ids=lambda p: repr(p)[:30])
def test_a_good_prompt_comes_out_as_the_general_path_makes_it(prompt: Any):
    assert valid_prompt(prompt) == _general_prompt(prompt)


@pytest.mark.parametrize(("prompt", "words"), REFUSED, ids=lambda p: repr(p)[:30])
def test_a_bad_prompt_gets_the_general_paths_words(prompt: Any, words: str):
    with pytest.raises(ValueError, match=words) as fast:
        valid_prompt(prompt)
    with pytest.raises(ValueError) as general:
        _general_prompt(prompt)
    assert str(fast.value) == str(general.value)


def test_the_fast_path_takes_plain_ids_only():
    assert _plain_token_ids(LONG_IDS) == LONG_IDS
    for bad in ([1, True], [1, 2.0], [1, -1], [1, INT32_MAX + 1], [1, "2"]):
        assert _plain_token_ids(bad) is None, bad


@pytest.mark.parametrize(("prompt", "words"), REFUSED[4:], ids=lambda p: repr(p)[:30])
def test_the_request_model_refuses_at_prompt(prompt: Any, words: str):
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate({"prompt": prompt})
    first = caught.value.errors()[0]
    assert first["loc"] == ("prompt",)
    assert words in str(first["ctx"]["error"])


def test_a_long_id_prompt_is_one_choice_of_the_same_ids():
    request = CompletionRequest.model_validate({"prompt": LONG_IDS, "stream": True})
    assert request.prompts() == [LONG_IDS]


def test_a_lone_surrogate_after_token_ids_is_still_found():
    assert lone_surrogate_path({"prompt": LONG_IDS}) is None
    assert lone_surrogate_path({"prompt": [1, 2.5, None, True, "x\ud800"]}) == "prompt.4"
    assert lone_surrogate_path({"prompt": [[1, 2], ["ok", "\udfff"]]}) == "prompt.1.1"
    with pytest.raises(Exception, match="lone UTF-16 surrogate"):
        check_raw_request({"prompt": [*LONG_IDS[:10], "\ud800"]})


def test_the_schema_of_prompt_is_the_four_shapes():
    schema = CompletionRequest.model_json_schema()["properties"]["prompt"]
    assert schema["anyOf"] == TypeAdapter(PromptShapes).json_schema()["anyOf"]
    assert len(schema["anyOf"]) == 4
