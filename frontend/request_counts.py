"""How many items a request may carry, checked on its raw JSON before anything is done per item.

A request's work grows with its prompts, messages and lists: each prompt is tokenized and becomes
a generation, each message is validated and rendered. Counts are the first thing checked, in
O(1) per field, so a body of a million prompts is refused before one prompt is looked at (it
would otherwise hold the event loop for tens of seconds, only to be refused). The OpenAPI
document states each limit as `maxItems` / `maxProperties` (`frontend.protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from frontend.errors import bad_request

MAX_PROMPTS = 256  # completions prompts in one request (each is a generation of its own)
MAX_MESSAGES = 1024  # chat messages in one request
MAX_CONTENT_PARTS = 32  # text parts of one message's content
MAX_STOP_STRINGS = 16  # the gateway searches the text for each after every token
MAX_STOP_TOKEN_IDS = 1024
MAX_METADATA_ENTRIES = 16  # as OpenAI's API


@dataclass(frozen=True)
class CountLimit:
    """At most `most` items in a field; `noun` names them, `why` (if any) says why the limit."""

    most: int
    noun: str
    why: str = ""


# Fields whose length the server bounds. A completions `prompt` counts only as a list of prompts
# (texts or lists of token ids); a list of token ids is one prompt, bounded by the context.
COUNT_LIMITS: dict[str, CountLimit] = {
    "prompt": CountLimit(
        MAX_PROMPTS, "prompts", "each is a generation of its own; send more in several requests"
    ),
    "messages": CountLimit(MAX_MESSAGES, "messages"),
    "stop": CountLimit(MAX_STOP_STRINGS, "strings", "each is searched for after every token"),
    "stop_token_ids": CountLimit(MAX_STOP_TOKEN_IDS, "token ids"),
    "metadata": CountLimit(MAX_METADATA_ENTRIES, "entries", "as in OpenAI's API"),
}
CONTENT_PARTS = CountLimit(MAX_CONTENT_PARTS, "parts", "join their text into fewer parts")


def check_counts(raw: dict[str, Any], fields: tuple[str, ...]) -> None:
    """A 400 naming the first of `fields` (keys of COUNT_LIMITS: those the endpoint declares)
    holding more items than the server takes; with `messages`, each message's content parts too."""
    if isinstance(raw.get("logit_bias"), dict) and raw["logit_bias"]:  # refused anyway: leave it unread
        raise bad_request("logit_bias is not supported", "logit_bias")
    for name in fields:
        value, limit = raw.get(name), COUNT_LIMITS[name]
        if isinstance(value, (list, dict)) and len(value) > limit.most and _counts(name, value):
            _refuse(name, len(value), limit)
    messages = raw.get("messages") if "messages" in fields else None
    if isinstance(messages, list):
        parts = CONTENT_PARTS
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and len(content) > parts.most:
                _refuse(f"messages.{i}.content", len(content), parts)


def _counts(name: str, value: list[Any] | dict[str, Any]) -> bool:
    """Whether the field's items are what its limit counts (a prompt list's items are prompts)."""
    return name != "prompt" or not isinstance(value[0], (int, float))  # type: ignore[index]


def _refuse(param: str, num_items: int, limit: CountLimit) -> None:
    why = f" ({limit.why})" if limit.why else ""
    raise bad_request(f"{param} has {num_items} {limit.noun}; at most {limit.most} are allowed{why}", param)
