"""Runs one `LLMEngine` on its own thread so servers can feed it from many threads at once.

The engine is single-threaded by contract; this loop is its only driver. Other threads submit
work with `call(fn)` (runs `fn(engine)` between two steps and returns a Future) and receive
per-request updates through the callback they registered. The loop sleeps on a condition
variable when there is nothing to do, never in a busy poll.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from splitserve.engine.llm_engine import LLMEngine, RequestUpdate

logger = logging.getLogger(__name__)

T = TypeVar("T")
UpdateCallback = Callable[[RequestUpdate], None]


class EngineLoop:
    """Owns the engine thread, the command queue and each request's update callback."""

    def __init__(self, engine: LLMEngine, name: str = "engine-loop") -> None:
        self.engine = engine
        self._commands: deque[tuple[Callable[[LLMEngine], Any], Future[Any]]] = deque()
        self._callbacks: dict[str, UpdateCallback] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between steps."""
        future: Future[T] = Future()
        with self._wake:
            if self._stopping:
                future.set_exception(RuntimeError("engine loop is stopped"))
                return future
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    def watch(self, request_id: str, callback: UpdateCallback) -> None:
        """Deliver every update of `request_id` to `callback` (on the engine thread; keep it quick)."""
        self._callbacks[request_id] = callback

    def unwatch(self, request_id: str) -> None:
        self._callbacks.pop(request_id, None)

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while (
                        not self._stopping and not self._commands and not self.engine.has_unfinished_requests
                    ):
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, future in commands:
                    self._run_command(fn, future)
                if self.engine.has_unfinished_requests:
                    self._step()
        except BaseException as exc:  # the engine is broken: fail everything loudly
            logger.exception("engine loop died")
            self.error = exc
        finally:
            self._fail_pending()

    def _run_command(self, fn: Callable[[LLMEngine], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(self.engine))
        except BaseException as exc:
            future.set_exception(exc)

    def _step(self) -> None:
        for update in self.engine.step():
            callback = self._callbacks.get(update.request.request_id)
            if callback is not None:
                callback(update)
            if update.finished:
                self._callbacks.pop(update.request.request_id, None)

    def _fail_pending(self) -> None:
        with self._wake:
            self._stopping = True
            pending = list(self._commands)
            self._commands.clear()
        for _, future in pending:
            if not future.done():
                future.set_exception(RuntimeError("engine loop stopped"))
