"""Noticing that a request's client left, with one task per request.

`ClientWatch` reads the request's `receive` on a task of its own until the client disconnects.
The request's own task marks the stretches a disconnect should cut short with `guard()`: a
disconnect inside one cancels the request's task there, and the `with` block then ends quietly,
`gone` saying why; one outside any (say while a worker is being released) is only noted, and
the next guard does not run its work at all. Only guarded work is ever cancelled, so what runs
between guards (releasing what a request holds) always runs whole.

Starlette's streaming response and a task per awaited step would each start a task and a
watcher of their own; this is one task for the whole request, and no task group.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from starlette.types import Receive


class ClientWatch:
    """Owns the watcher task of one request's client. Not reusable; `close()` when the response
    is done (idempotent)."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = False  # the client disconnected
        self._task: asyncio.Task[object] | None = None  # the request's task, while guarded
        self._watcher: asyncio.Task[None] | None = None
        self._cancelled = False  # the watcher cancelled the guarded task
        self._closed = False

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A stretch of the calling task that a disconnect cancels; the `with` then ends without
        an error (`gone` is True). Check `gone` first: a guard entered after the client left
        would only be cancelled at its first wait."""
        if self._watcher is None and not self._closed:
            self._watcher = asyncio.ensure_future(self._watch())
        task = asyncio.current_task()
        assert task is not None and self._task is None, "one guard at a time, inside a task"
        self._task, self._cancelled = task, False
        try:
            yield
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
            self._cancelled = False
            if task.uncancel() > 0:
                raise  # cancelled from elsewhere too (the server shutting down)
        finally:
            self._task = None
            if self._cancelled:  # the work turned our cancellation into something else: balance it
                self._cancelled = False
                task.uncancel()

    async def _watch(self) -> None:
        try:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a server that cannot say: nothing to watch
            return
        self.gone = True
        if self._task is not None:  # guarded: the task is waiting inside the guard; cut it short
            self._cancelled = True
            self._task.cancel()

    def close(self) -> None:
        """Stop watching (the response is done)."""
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
