"""The OpenAI API shapes a benchmark speaks: endpoint URLs, streaming request bodies, and which
stream chunks carry generated text."""

from __future__ import annotations

from typing import Any

ENDPOINTS = ("completions", "chat")
_PATHS = {"completions": "/completions", "chat": "/chat/completions"}


def endpoint_url(base_url: str, endpoint: str) -> str:
    """The endpoint's URL under `base_url`, which may end in /v1 or not (then /v1 is added)."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base + _PATHS[endpoint]


def streaming_body(
    endpoint: str,
    model: str,
    prompt: str | list[int] | list[dict[str, str]],
    max_tokens: int,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streaming request for exactly `max_tokens` tokens (EOS ignored), usage in the last chunk.

    `prompt` is the completions prompt (text or token ids), or the chat messages.
    """
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    body["messages" if endpoint == "chat" else "prompt"] = prompt
    body.update(extra_body or {})
    return body


def chunk_text(endpoint: str, event: dict[str, Any]) -> str | None:
    """The generated text a stream event carries, or None when it carries none.

    A chunk counts as content when its first choice has `text` (completions) or `delta.content`
    (chat), even an empty string: a byte-level tokenizer's token may decode to nothing yet. A
    chat chunk that only announces the assistant role does not count; nor does the usage chunk.
    """
    choices = event.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if endpoint == "completions":
        text = choice.get("text")
        return text if isinstance(text, str) else None
    delta = choice.get("delta") or {}
    content = delta.get("content")
    if not isinstance(content, str):
        return None
    if content == "" and delta.get("role"):
        return None  # the role announcement
    return content


def chunk_token_ids(event: dict[str, Any]) -> list[int]:
    """The generated token ids a completions stream event names in its logprobs (`token_id:N`,
    asked for with `return_tokens_as_token_ids`); empty when it names none."""
    choices = event.get("choices")
    logprobs = choices[0].get("logprobs") if choices and isinstance(choices[0], dict) else None
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list):
        return []
    ids = []
    for token in tokens:
        if not isinstance(token, str) or not token.startswith("token_id:"):
            raise ValueError(
                f"a logprobs token is {token!r}, not 'token_id:N': the server ignored "
                "return_tokens_as_token_ids, so the multi-turn-ids dataset cannot get the reply's ids"
            )
        ids.append(int(token.removeprefix("token_id:")))
    return ids


def error_message(payload: Any, fallback: str) -> str:
    """The message of an OpenAI error body (`{"error": {"message": ...}}`), else `fallback`."""
    if isinstance(payload, dict):
        error = payload.get("error", payload.get("detail"))
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
    return fallback
