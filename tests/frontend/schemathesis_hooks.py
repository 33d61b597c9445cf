"""schemathesis hooks for `test_schemathesis.py`'s run of every check: drop only the failures that
no JSON Schema can prevent, each named with the reason the document cannot state it.

Loaded by the schemathesis command through `SCHEMATHESIS_HOOKS=tests.frontend.schemathesis_hooks`.
Everything else a check finds fails the test.
"""

from __future__ import annotations

import json

import schemathesis

# A schema-valid request the server refuses, and why the document cannot say so. Matched on the
# error's code, or on words of its message (the server's own, which tests elsewhere pin down).
INEXPRESSIBLE_REFUSALS = {
    "request_too_large": "more prompts than the decode pool's slots: a number that changes as workers come and go",
    "this model's context is": "prompt tokens plus max_tokens past the context: a text's token count is the tokenizer's",
    "as the template renders them": "the prompt the chat template renders is past gateway.max_prompt_chars: a sum over messages, markup included",
    "must not exceed max_tokens": "min_tokens above max_tokens: JSON Schema compares no field with another",
    "best_of must be in [n,": "best_of below n: JSON Schema compares no field with another",
    "best_of > n cannot be streamed": "best_of above n with stream: the best are known only at the end",
}


def inexpressible(status_code: int, body: str) -> str | None:
    """Why a refusal of a schema-valid request is one the document cannot state; None if it can."""
    if status_code != 400:
        return None
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    for words, why in INEXPRESSIBLE_REFUSALS.items():
        if error.get("code") == words or words in str(error.get("message", "")):
            return why
    return None


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:  # type: ignore[no-untyped-def]
    """Keep every failure but a schema-valid request refused for what a schema cannot say."""
    rejected_valid = type(failure).__name__ == "RejectedPositiveData"
    return not (rejected_valid and inexpressible(response.status_code, response.text))
