"""Checks on a request's raw JSON before its fields are read, and the safe log of unknown fields.

* Text that is not Unicode: JSON may carry a lone UTF-16 surrogate (`"\\ud800"`), which no
  tokenizer, protobuf string or UTF-8 writer takes; in a field the server reads, or in any field
  name, it is refused with a 400 naming where it is. The search is one pass in C for a list of
  numbers or of valid texts, and gives up naming the place past MAX_WALKED_NODES values.
* Fields OpenAI or vLLM define whose effect this gateway cannot give (`REFUSED_FIELDS`): a 400
  naming them, so a request is never answered as if it had been honoured.
* Fields nobody defines are ignored, and logged in one bounded, escaped line per request (a name
  with a newline or an ANSI escape cannot forge or colour a log line).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from frontend.errors import bad_request
from frontend.request_counts import check_counts

logger = logging.getLogger(__name__)

MAX_LOGGED_FIELDS = 8  # names in the one warning line per request
MAX_LOGGED_NAME_CHARS = 40  # characters of each name, escaped
MAX_WALKED_NODES = 1024  # values the surrogate search visits one by one before one pass in C
ASKS_FOR_NOTHING: tuple[Any, ...] = (
    None,
    False,
    "",
    [],
    {},
)  # what a refused field may hold besides its `allowed`
_NO_TEXT = frozenset({int, float, bool, type(None)})  # JSON values that hold no string


@dataclass(frozen=True)
class Refusal:
    """Why a field is refused, and the values that ask for nothing (allowed besides null, false
    and empty)."""

    why: str
    allowed: tuple[object, ...] = ()


_TOOLS = Refusal("this server has no tool calling", ("none",))
_GUIDED = Refusal("this server has no guided decoding or structured output")

REFUSED_FIELDS: dict[str, Refusal] = {
    # OpenAI
    "tool_choice": _TOOLS,
    "function_call": _TOOLS,
    "functions": _TOOLS,
    "modalities": Refusal("this model writes text only", (["text"],)),
    "audio": Refusal("this model writes text only"),
    "prediction": Refusal("this server takes no predicted output"),
    "reasoning_effort": Refusal("this model has no reasoning-effort control"),
    "verbosity": Refusal("this model has no verbosity control"),
    "web_search_options": Refusal("this server has no web search"),
    "service_tier": Refusal("this server has one service tier", ("auto", "default")),
    # vLLM's extras this server does not implement
    "guided_json": _GUIDED,
    "guided_regex": _GUIDED,
    "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED,
    "structured_outputs": _GUIDED,
    "use_beam_search": Refusal("this server has no beam search"),
    "length_penalty": Refusal("this server has no beam search", (1, 1.0)),
    "prompt_logprobs": Refusal("this server returns no prompt logprobs"),
    "allowed_token_ids": Refusal("the sampler takes no allow list"),
    "bad_words": Refusal("the sampler takes no bad-words list"),
    "logits_processors": Refusal("the sampler takes no logits processors"),
    "truncate_prompt_tokens": Refusal("prompts are never truncated; shorten the prompt"),
    "chat_template": Refusal("the checkpoint's own chat template is always used"),
    "continue_final_message": Refusal("the last message is never continued; add_generation_prompt only"),
    "documents": Refusal("the chat template is given no documents"),
    "echo": Refusal("the prompt is not returned with the output"),
    "priority": Refusal("this server has no request priorities", (0,)),
}


def check_raw_request(
    raw: Any, counted_fields: tuple[str, ...] = (), read_fields: Collection[str] | None = None
) -> None:
    """A 400 for a field with more items than the server takes (`counted_fields`, first: see
    `frontend.request_counts`), a lone surrogate in a field name or in a field the server reads
    (`read_fields`; None: every field), or a refused field that asks for something.

    Called on the parsed JSON before pydantic reads it; anything not an object is left to pydantic."""
    if not isinstance(raw, dict):
        return
    check_counts(raw, counted_fields)
    read = raw if read_fields is None else {k: v for k, v in raw.items() if k in read_fields}
    try:  # an unread field's value is dropped unseen: only its name is checked (it is logged)
        bad_path = None if _is_unicode("".join(raw)) else "<field name>"
        bad_path = bad_path or lone_surrogate_path(read, max_nodes=MAX_WALKED_NODES)
    except WalkTooLong:  # a field of many small pieces: one pass in C says whether, not where
        bad_path = None if _is_unicode(json.dumps(read, ensure_ascii=False)) else ""
    if bad_path is not None:
        raise bad_request(
            f"{bad_path or 'the request'} is not valid Unicode: it holds a lone UTF-16 surrogate "
            "(an escape between \\ud800 and \\udfff that is not half of a pair); send UTF-8 text",
            bad_path or None,
        )
    for name, refusal in REFUSED_FIELDS.items():
        value = raw.get(name)
        if value is None or any(
            json_equal(value, nothing) for nothing in (*ASKS_FOR_NOTHING, *refusal.allowed)
        ):
            continue
        allowed = ", ".join(repr(v) for v in refusal.allowed)
        hint = f"leave it out{f' or send {allowed}' if allowed else ''}"
        raise bad_request(f"{name} is not supported: {refusal.why}; {hint}", name)


def json_equal(a: Any, b: Any) -> bool:
    """Equal as JSON values: numbers by value (1 and 1.0), but a boolean only to a boolean (Python
    has `0 == False`; JSON Schema's `enum` does not)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


class WalkTooLong(Exception):
    """The walk of `lone_surrogate_path` visited its `max_nodes` and gave up."""


def lone_surrogate_path(value: Any, path: str = "", max_nodes: float = math.inf) -> str | None:
    """The dotted path (`messages.0.content`) of the first string, or field name, in `value` that
    is not encodable as UTF-8; None when every one is. A list of numbers, or of strings that are
    all valid, is one step; past `max_nodes` steps, WalkTooLong."""
    return _find(value, path, [max_nodes])


def _find(value: Any, path: str, budget: list[float]) -> str | None:
    budget[0] -= 1
    if budget[0] < 0:
        raise WalkTooLong
    if isinstance(value, str):
        return None if _is_unicode(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _is_unicode(key):
                return f"{path}.<field name>" if path else "<field name>"
            found = _find(item, child, budget)
            if found is not None:
                return found
    elif isinstance(value, list):
        kinds = set(map(type, value))
        if kinds <= _NO_TEXT:  # a list of token ids: one pass in C, no frame per id
            return None
        if kinds == {str} and _is_unicode("".join(value)):  # texts, all valid: one pass too
            return None
        for i, item in enumerate(value):
            found = _find(item, f"{path}.{i}" if path else str(i), budget)
            if found is not None:
                return found
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():  # the common case, and cheap
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def log_unknown_fields(names: Iterable[str]) -> None:
    """One warning line naming the fields (escaped, each and their number bounded); the fields
    of `REFUSED_FIELDS`, known and here asking for nothing, are left out."""
    names = sorted(name for name in names if name not in REFUSED_FIELDS)
    if not names:
        return
    shown = [_escaped(name) for name in names[:MAX_LOGGED_FIELDS]]
    more = f" and {len(names) - MAX_LOGGED_FIELDS} more" if len(names) > MAX_LOGGED_FIELDS else ""
    logger.warning("ignoring unknown request fields: %s%s", ", ".join(shown), more)


def _escaped(name: str) -> str:
    """The name as a Python literal (control characters, escapes and non-ASCII spelled out), cut."""
    text = ascii(name[: MAX_LOGGED_NAME_CHARS + 1])
    return text if len(name) <= MAX_LOGGED_NAME_CHARS else text[:-1] + "...'"
