"""Limits the OpenAPI document states for what the server enforces outside pydantic.

Many of a request's limits are checked past pydantic, each with its own message: the sampling
ranges in `SamplingParams` (`top_p must be in (0, 1] (got 0)`), the context and the vocabulary in
`frontend.inputs`. `documented(...)` writes such a limit into a field's JSON schema without
pydantic enforcing it (so the message stays the server's). Limits that depend on what a gateway
serves (its context, vocabulary and character limit) are written as a marker that `Bounds.fill`
replaces in each app's document. `state_request_limits` adds what a request model's fields do
not show (the refused fields, cross-field rules as `if`/`then`), `content_schema` a message's
content as the server takes it. The document then says every limit a schema can say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from frontend.request_checks import ASKS_FOR_NOTHING, REFUSED_FIELDS, json_equal
from frontend.request_counts import MAX_CONTENT_PARTS

BOUND_KEY = "x-splitserve-bound"  # the marker; never left in a served document
MAX_NEW_TOKENS = "max_new_tokens"  # an integer at most max_model_len - 1 (a prompt has a token)
TOKEN_ID = "token_id"  # an integer at most the vocabulary size - 1 (when the gateway knows it)
PROMPT_CHARS = "prompt_chars"  # a text at most gateway.max_prompt_chars characters long
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Cross-field rules the server enforces (JSON Schema's if/then), keyed by the field they are about.
_RULES = {
    "stream_options": {  # only with stream: true
        "if": {"properties": {"stream_options": {"type": "object"}}, "required": ["stream_options"]},
        "then": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
    },
    "top_logprobs": {  # only with logprobs: true
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
    },
}


def documented(*, bound: str | None = None, **keywords: Any) -> Any:
    """A `Field` adding JSON Schema `keywords` to a field's schema (None removes one) and, with
    `bound`, the marker of a deployment's limit; pydantic enforces none of it."""

    def edit(schema: dict[str, Any]) -> None:
        for key, value in keywords.items():
            if value is None:
                schema.pop(key, None)
            else:
                schema[key] = value
        if bound is not None:
            schema[BOUND_KEY] = bound

    return Field(json_schema_extra=edit)


def state_request_limits(schema: dict[str, Any]) -> None:
    """A request's schema, with what the server also enforces: the refused fields (each with the
    values that ask for nothing, `frontend.request_checks`) and the cross-field rules."""
    properties = schema.setdefault("properties", {})
    for name, refusal in REFUSED_FIELDS.items():
        if name not in properties:
            allowed = [*ASKS_FOR_NOTHING, *refusal.allowed]
            properties[name] = {
                "description": f"refused unless it asks for nothing: {refusal.why}",
                "enum": [
                    value
                    for i, value in enumerate(allowed)
                    if not any(json_equal(value, v) for v in allowed[:i])
                ],
            }
    rules = [rule for name, rule in _RULES.items() if name in properties]
    if rules:
        schema["allOf"] = rules


def content_schema(schema: dict[str, Any]) -> None:
    """A message's content as the server takes it: text, or text parts; never null."""
    text = {"type": "string", BOUND_KEY: PROMPT_CHARS}  # the template renders all of it
    part = {
        "type": "object",
        "properties": {"type": {"const": "text"}, "text": text},
        "required": ["type", "text"],
    }
    schema.pop("default", None)
    schema["anyOf"] = [text, {"type": "array", "items": part, "maxItems": MAX_CONTENT_PARTS}]


@dataclass(frozen=True)
class Bounds:
    """What one gateway serves, for its document; a limit left None is left unsaid (`vocab_size`
    without a tokenizer)."""

    max_model_len: int | None = None
    max_prompt_chars: int | None = None
    vocab_size: int | None = None

    def fill(self, node: Any) -> None:
        """Replace every marker under `node` with its limit, and write numeric limits that are
        whole numbers as integers (FastAPI's document model makes them floats: 2**63 - 1 came
        out as 2**63, a value the server refuses)."""
        if isinstance(node, list):
            for item in node:
                self.fill(item)
            return
        if not isinstance(node, dict):
            return
        kind = node.pop(BOUND_KEY, None)
        if kind == MAX_NEW_TOKENS and self.max_model_len is not None:
            node["maximum"] = self.max_model_len - 1
        elif kind == TOKEN_ID and self.vocab_size is not None:
            node["maximum"] = self.vocab_size - 1
        elif kind == PROMPT_CHARS and self.max_prompt_chars is not None:
            node["maxLength"] = self.max_prompt_chars
        for key in _NUMBER_KEYWORDS:
            value = node.get(key)
            if isinstance(value, float) and value.is_integer():
                node[key] = int(value)
        for value in node.values():
            self.fill(value)
