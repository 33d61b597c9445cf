"""A plain OpenAI-compatible server for the bench tests: streaming completions and chat, a
deterministic reply, failures on demand, and a log of everything it received.

The reply to a request is `max_tokens` words (` w<crc>_<i>`, the crc of the prompt), one
content chunk each (completions name ids for them in logprobs when asked: `reply_token_ids`),
then the usage chunk and `data: [DONE]`. `fail(body)` may return an HTTP
status to answer with instead, `error_event(body)` may ask for an error event after the first
two chunks, and `gate_in_flight=N` holds every request until N are in flight at once (or 10 s
pass), which makes a concurrency cap observable without timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.server import GatewayServer

GATE_TIMEOUT_S = 10.0


@dataclass
class Received:
    """One request the fake served: its body, the reply text it streamed, the status it answered."""

    endpoint: str
    body: dict[str, Any]
    reply: str = ""
    status: int = 200


@dataclass
class FakeOpenAI:
    """Owns the fake app and its log; `max_in_flight` is the most requests it had open at once."""

    fail: Callable[[dict[str, Any]], int | None] = lambda body: None
    error_event: Callable[[dict[str, Any]], bool] = lambda body: False
    send_usage: bool = True
    cached_tokens: Callable[[dict[str, Any]], int] | None = None  # usage.prompt_tokens_details, if set
    gate_in_flight: int | None = None
    received: list[Received] = field(default_factory=list)
    max_in_flight: int = 0
    _in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> FastAPI:
        app = FastAPI()
        gate = asyncio.Event()

        async def handle(endpoint: str, raw: Request) -> Response:
            body = await raw.json()
            received = Received(endpoint, body)
            with self._lock:
                self.received.append(received)
                self._in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self._in_flight)
                if self.gate_in_flight is not None and self._in_flight >= self.gate_in_flight:
                    gate.set()
            if self.gate_in_flight is not None:
                # On a timeout the test's assertion on max_in_flight fails, rather than the test hanging.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(gate.wait(), GATE_TIMEOUT_S)
            status = self.fail(body)
            if status is not None:
                self._leave()
                received.status = status
                error = {"message": f"fake failure {status}", "type": "fake", "code": status}
                return JSONResponse({"error": error}, status_code=status)
            return StreamingResponse(self._events(received), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(raw: Request) -> Response:
            return await handle("completions", raw)

        @app.post("/v1/chat/completions")
        async def chat(raw: Request) -> Response:
            return await handle("chat", raw)

        return app

    def _leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    async def _events(self, received: Received) -> AsyncIterator[str]:
        body, chat = received.body, received.endpoint == "chat"
        try:
            words = reply_words(body)
            if chat:
                yield _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i, word in enumerate(words):
                if i == 2 and self.error_event(body):
                    yield _event({"error": {"message": "fake mid-stream failure", "code": 500}})
                    yield "data: [DONE]\n\n"
                    return
                finish = "length" if i == len(words) - 1 else None
                piece = {"delta": {"content": word}} if chat else {"text": word}
                if not chat and body.get("return_tokens_as_token_ids") and body.get("logprobs") is not None:
                    piece["logprobs"] = {"tokens": [f"token_id:{reply_token_ids(body)[i]}"]}
                yield _event({"choices": [{"index": 0, "finish_reason": finish, **piece}]})
                received.reply += word
                await asyncio.sleep(0)  # let other streams interleave
            if self.send_usage:
                usage = {"prompt_tokens": prompt_tokens(body), "completion_tokens": len(words)}
                usage = {**usage, "total_tokens": sum(usage.values())}
                if self.cached_tokens is not None:
                    usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens(body)}
                yield _event({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            self._leave()


def reply_words(body: dict[str, Any]) -> list[str]:
    """The fake's reply to `body`: `max_tokens` words that depend on the prompt."""
    crc = zlib.crc32(json.dumps(body.get("prompt", body.get("messages")), sort_keys=True).encode())
    return [f" w{crc % 10_000}_{i}" for i in range(body["max_tokens"])]


def reply_token_ids(body: dict[str, Any]) -> list[int]:
    """The ids the fake names for its reply's words in completions logprobs, when the body asks
    for `return_tokens_as_token_ids` with `logprobs`."""
    crc = zlib.crc32(json.dumps(body["prompt"], sort_keys=True).encode())
    return [3 + (crc + i) % 1000 for i in range(body["max_tokens"])]


def prompt_tokens(body: dict[str, Any]) -> int:
    """What the fake reports as the prompt's length: ids counted, text counted in words, plus 1000
    (so a test can tell the server's count from the client's)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return 1000 + len(prompt)
    text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in body["messages"])
    return 1000 + len(text.split())


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@contextlib.contextmanager
def serving(fake: FakeOpenAI) -> Iterator[str]:
    """Serve `fake` on 127.0.0.1 (a free port) and yield its base URL; stopped on exit."""
    server = GatewayServer(fake.app(), "127.0.0.1", 0)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()
