"""Driving a request's generations to an HTTP response: whole, or streamed as SSE.

Shared by completions and chat: the route's `ResponseView` renders steps into chunks or a
whole response; this module starts the generations, merges their steps, and guarantees
every generation is released however the response ends (finished, failed, client gone).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Protocol

import anyio
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from frontend.admission_queue import SlotAdmission
from frontend.errors import GatewayError
from frontend.generate import Generation
from frontend.steps import Step


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
    ticket is given back once every generation is released, however the response ends."""
    queue: SlotAdmission = raw.app.state.admission_queue
    timeout_s = min(g.deadline_s for g in gens) - time.monotonic()
    try:
        ticket = await _unless_disconnected(raw, queue.acquire(len(gens), timeout_s))
    except BaseException as exc:  # refused (400/429/503): nothing was reserved anywhere
        await _release_all(gens, error=not isinstance(exc, asyncio.CancelledError))
        raise
    if isinstance(ticket, Response):  # the client left while queued
        await _release_all(gens)
        return ticket
    try:
        response = await _run(raw, gens, stream, include_usage, view, ticket.release)
    except BaseException:
        ticket.release()
        raise
    if not isinstance(response, _ReleasingStream):
        ticket.release()
    return response


async def _run(
    raw: Request,
    gens: list[Generation],
    stream: bool,
    include_usage: bool,
    view: ResponseView,
    on_stream_end: Callable[[], None],
) -> Response:
    if not stream:
        return await _unless_disconnected(raw, _collect(gens, view.whole))
    try:
        firsts = await _unless_disconnected(raw, _start_all(gens))
    except BaseException as exc:
        await _release_all(gens, error=not isinstance(exc, asyncio.CancelledError))
        raise
    if isinstance(firsts, Response):  # the client left while we waited
        await _release_all(gens)
        return firsts

    async def events() -> AsyncGenerator[str, None]:
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

    body = events()

    async def on_close() -> None:
        await body.aclose()
        await _release_all(gens)
        on_stream_end()

    return _ReleasingStream(body, on_close, media_type="text/event-stream")


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


async def _unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (then a 499, never sent)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return Response(status_code=499)
        raise
    finally:
        watcher.cancel()


class _ReleasingStream(StreamingResponse):
    """A stream that runs `on_close` however it ends: finished, failed or client gone."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
