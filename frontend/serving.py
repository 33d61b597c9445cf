"""Driving a request's generations to an HTTP response: whole, or streamed as SSE.

Shared by completions and chat: the route's `ResponseView` renders steps into chunks or a
whole response; this module starts the generations, merges their steps, and guarantees
every generation is released however the response ends (finished, failed, client gone).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from frontend.admission_queue import SlotAdmission
from frontend.client_watch import ClientWatch
from frontend.errors import GatewayError
from frontend.generate import Generation
from frontend.steps import Step

T = TypeVar("T")


class ResponseView(Protocol):
    """How one endpoint renders a request's steps: as stream chunks, or as one whole response."""

    def chunk(self, index: int, step: Step) -> list[str]:
        """The SSE data payloads (JSON) for one step of choice `index`."""

    def whole(self, steps: list[list[Step]]) -> BaseModel:
        """The whole response from every choice's steps."""

    def usage_chunk(self) -> str:
        """The last chunk of a stream that asked for usage."""


async def serve(
    raw: Request, gens: list[Generation], stream: bool, include_usage: bool, view: ResponseView
) -> Response:
    """Admit the request (it may wait for decode room: frontend.admission_queue), then run its
    generations; a stream once every first token is in, else the whole response. The admission
    ticket is given back once every generation is released, however the response ends. A client
    that leaves while the request waits (for room, a prefill, a step) cuts the wait short
    (`frontend.client_watch`); what its generations hold is released."""
    queue: SlotAdmission = raw.app.state.admission_queue
    timeout_s = min(g.deadline_s for g in gens) - time.monotonic()
    watch = ClientWatch(raw.receive)
    try:
        try:
            ticket = await _unless_disconnected(watch, queue.acquire(len(gens), timeout_s))
        except BaseException as exc:  # refused (400/429/503): nothing was reserved anywhere
            await _release_all(gens, error=not isinstance(exc, asyncio.CancelledError))
            raise
        if isinstance(ticket, Response):  # the client left while queued
            await _release_all(gens)
            return ticket
        try:
            response = await _run(watch, gens, stream, include_usage, view, ticket.release)
        except BaseException:
            ticket.release()
            raise
    except BaseException:
        watch.close()
        raise
    if not isinstance(response, _ReleasingStream):
        watch.close()
        ticket.release()
    if not isinstance(response, Response):  # a whole response, rendered as FastAPI renders a model
        response = JSONResponse(jsonable_encoder(response))
    return response


async def _run(
    watch: ClientWatch,
    gens: list[Generation],
    stream: bool,
    include_usage: bool,
    view: ResponseView,
    on_stream_end: Callable[[], None],
) -> Response:
    if not stream:
        return await _unless_disconnected(watch, _collect(gens, view.whole))
    try:
        firsts = await _unless_disconnected(watch, _start_all(gens))
    except BaseException as exc:
        await _release_all(gens, error=not isinstance(exc, asyncio.CancelledError))
        raise
    if isinstance(firsts, Response):  # the client left while we waited
        await _release_all(gens)
        return firsts

    if all(step.finish_reason is not None for step in firsts):  # nothing more to wait for
        events = [
            f"data: {data}\n\n" for index, step in enumerate(firsts) for data in view.chunk(index, step)
        ]
        if include_usage:
            events.append(f"data: {view.usage_chunk()}\n\n")
        events.append("data: [DONE]\n\n")
        body: AsyncIterator[str] | str = "".join(events)
    else:

        async def more_events() -> AsyncGenerator[str, None]:
            try:
                async with aclosing(_merged_steps(gens, firsts)) as steps:
                    async for index, step in steps:
                        for data in view.chunk(index, step):
                            yield f"data: {data}\n\n"
                if include_usage:
                    yield f"data: {view.usage_chunk()}\n\n"
            except GatewayError as exc:
                await _release_all(gens, error=True)
                yield f"data: {json.dumps(exc.body())}\n\n"
            yield "data: [DONE]\n\n"

        body = more_events()

    async def on_close() -> None:
        if not isinstance(body, str):
            await body.aclose()  # type: ignore[attr-defined]
        await _release_all(gens)
        on_stream_end()

    return _ReleasingStream(body, watch, on_close)


async def _collect(gens: list[Generation], whole: Callable[[list[list[Step]]], Any]) -> Any:
    steps: list[list[Step]] = [[] for _ in gens]
    try:
        firsts = await _start_all(gens)
        async with aclosing(_merged_steps(gens, firsts)) as merged:
            async for index, step in merged:
                steps[index].append(step)
    except BaseException as exc:
        await _release_all(gens, error=not isinstance(exc, asyncio.CancelledError))
        raise
    await _release_all(gens)
    return whole(steps)


async def _start_all(gens: list[Generation]) -> list[Step]:
    if len(gens) == 1:
        return [await gens[0].start()]
    return await _all_or_cancel([g.start() for g in gens])


async def _merged_steps(gens: list[Generation], firsts: list[Step]) -> AsyncGenerator[tuple[int, Step], None]:
    """Every generation's steps as they come, firsts first; the caller releases the gens."""
    for index, step in enumerate(firsts):
        yield index, step
    live = [i for i, step in enumerate(firsts) if step.finish_reason is None]
    if len(live) == 1:
        index = live[0]
        while True:
            step = await gens[index].next()
            yield index, step
            if step.finish_reason is not None:
                return
    pending = {asyncio.ensure_future(gens[i].next()): i for i in live}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                step = task.result()
                yield index, step
                if step.finish_reason is None:
                    pending[asyncio.ensure_future(gens[index].next())] = index
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def _all_or_cancel(coros: list[Awaitable[Step]]) -> list[Step]:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _release_all(gens: list[Generation], error: bool = False) -> None:
    with anyio.CancelScope(shield=True):
        for gen in gens:
            await gen.release(error=error)


async def _unless_disconnected(watch: ClientWatch, work: Coroutine[Any, Any, T]) -> T | Response:
    """Await `work`, cut short if the client disconnects first (then a 499, never sent)."""
    if watch.gone:
        work.close()
        return Response(status_code=499)
    with watch.guard():
        return await work
    return Response(status_code=499)  # the guard ended the work: the client left


class _ReleasingStream(Response):
    """A server-sent event stream that runs `on_close` however it ends: finished, failed or client
    gone. `body` is the whole stream when every event is known at once, else its events as they
    come, read while `watch` stands guard: a client that leaves ends the stream at its next wait."""

    media_type = "text/event-stream"

    def __init__(
        self, body: AsyncIterator[str] | str, watch: ClientWatch, on_close: Callable[[], Awaitable[None]]
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(None)
        self._body = body
        self._watch = watch
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            body = self._body
            if isinstance(body, str):
                await send({"type": "http.response.body", "body": body.encode(), "more_body": False})
                return
            if self._watch.gone:
                return
            with self._watch.guard():
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._watch.close()
            with anyio.CancelScope(shield=True):
                await self._on_close()
