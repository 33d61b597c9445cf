"""Sending one streaming request and timing every chunk of its server-sent events."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.api import chunk_text, chunk_token_ids, error_message

_MAX_ERROR_CHARS = 1000


@dataclass(frozen=True)
class StreamResult:
    """One streamed request as the client saw it; times are `time.perf_counter()` seconds.

    `chunk_s` holds the arrival of every content-bearing chunk, `end_s` that of the stream's
    end (`data: [DONE]`) or of the failure. `token_ids` are the generated ids the chunks' logprobs
    name (`token_id:N`; empty unless the request asked for them). `error` is empty exactly when the request succeeded:
    an HTTP status other than 200, an error event, a broken connection, a stream that ends
    without `[DONE]` or without any content all fail it.
    """

    send_s: float
    end_s: float
    chunk_s: tuple[float, ...] = ()
    text: str = ""
    token_ids: tuple[int, ...] = ()
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server sent it
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], endpoint: str, *, want_token_ids: bool = False
) -> StreamResult:
    """POST `body` to `url` and read its event stream to the end; never raises for the server's faults.

    With `want_token_ids` (the body asks for `token_id:N` logprobs) the generated ids are collected,
    and a stream whose logprobs name tokens otherwise fails."""
    send_s = time.perf_counter()
    chunk_s: list[float] = []
    pieces: list[str] = []
    token_ids: list[int] = []
    usage: dict[str, Any] = {}

    def result(error: str = "") -> StreamResult:
        return StreamResult(
            send_s=send_s,
            end_s=time.perf_counter(),
            chunk_s=tuple(chunk_s),
            text="".join(pieces),
            token_ids=tuple(token_ids),
            prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
            completion_tokens=_int_or_none(usage.get("completion_tokens")),
            cached_tokens=_cached_tokens(usage),
            error=error[:_MAX_ERROR_CHARS],
        )

    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                return result(
                    f"HTTP {response.status_code}: {error_message(_json_or_none(raw), raw.strip())}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (keep-alives), event names
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    if not chunk_s:
                        return result("the stream ended without any content chunk")
                    return result()
                arrival_s = time.perf_counter()
                event = _json_or_none(data)
                if not isinstance(event, dict):
                    return result(f"malformed stream event: {data[:200]}")
                if "error" in event:
                    return result(f"error event: {error_message(event, data)}")
                text = chunk_text(endpoint, event)
                if text is not None:
                    chunk_s.append(arrival_s)
                    pieces.append(text)
                if want_token_ids:
                    try:
                        token_ids.extend(chunk_token_ids(event))
                    except ValueError as exc:
                        return result(str(exc))
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
            return result("the stream ended without data: [DONE]")
    except httpx.HTTPError as exc:
        return result(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    return _int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
