"""Runs one `LLMEngine` on its own thread so servers can feed it from many threads at once.

The engine is single-threaded by contract; this loop is its only driver. Other threads submit
work with `call(fn)` (runs `fn(engine)` between two steps and returns a Future) and receive
per-request updates through the callback they registered. The loop sleeps on a condition
variable when there is nothing to do, never in a busy poll.

After every step and every batch of commands the loop copies what load reports read into an
`EngineSnapshot` and runs its observers, so `snapshot()` answers from any thread at once, even
while a step takes seconds; `snapshot_age_s()` says how far behind it may be, which is also how
a stuck engine shows (it grows without bound while a step or command never returns).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from splitserve.engine.engine_snapshot import EngineSnapshot
from splitserve.engine.llm_engine import LLMEngine, RequestUpdate

logger = logging.getLogger(__name__)

T = TypeVar("T")
UpdateCallback = Callable[[RequestUpdate], None]
Observer = Callable[[LLMEngine], None]


class EngineLoop:
    """Owns the engine thread, the command queue, each request's update callback, and the
    latest `EngineSnapshot` (taken after every step and every batch of commands, and before a
    command's future resolves: never behind by more than the step or command in progress)."""

    def __init__(
        self, engine: LLMEngine, name: str = "engine-loop", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine = engine
        self.clock = clock  # for snapshot times and ages; tests pass a fake one
        self._commands: deque[tuple[Callable[[LLMEngine], Any], Future[Any]]] = deque()
        self._callbacks: dict[str, UpdateCallback] = {}
        self._observers: list[Observer] = []  # engine thread only: changed through commands
        self._wake = threading.Condition()
        self._snapshot_taken = threading.Condition()  # notified after each snapshot (`wait_until`)
        self._stopping = False
        self.error: BaseException | None = None
        # Taken here, before the thread exists, so there is always one to read.
        self._snapshot = EngineSnapshot.of(engine, clock())
        # since when the engine may differ from the snapshot (its last publish, or the wake-up
        # after an idle wait); None while the thread waits for work: the snapshot is current
        self._busy_since_s: float | None = None
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

    def snapshot(self) -> EngineSnapshot:
        """The engine's load as of its last pass, without waiting for the one in progress.
        Raises RuntimeError once the loop has stopped or died (its numbers would never change)."""
        if not self.alive:
            raise RuntimeError(f"engine loop is not running ({self.error or 'stopped'}); restart the worker")
        return self._snapshot

    def wait_until(self, predicate: Callable[[EngineSnapshot], bool], timeout_s: float) -> bool:
        """Block until a snapshot satisfies `predicate` (checked on the latest one now, then on
        each new one as the engine thread takes it); False after `timeout_s`, or once the loop
        has stopped or died. For background threads that should not compete with some kind of
        step (e.g. a publisher waiting out a prompt's prefill)."""

        def gone() -> bool:
            return self._stopping or not self.alive

        with self._snapshot_taken:
            return self._snapshot_taken.wait_for(lambda: gone() or predicate(self._snapshot), timeout_s) and (
                not gone()
            )

    def snapshot_age_s(self) -> float:
        """How far behind the engine `snapshot()` may be: 0 while the thread waits for work (the
        engine cannot change then), else how long the pass in progress (a step, a command) has
        run. A step that never returns makes it grow without bound: that is how a stuck engine shows."""
        since_s = self._busy_since_s
        return 0.0 if since_s is None else max(0.0, self.clock() - since_s)

    def observe(self, fn: Observer) -> Future[None]:
        """Run `fn(engine)` on the engine thread each time a snapshot is taken from now on (the
        first soon, even when idle), right after it (keep it quick: it delays the next step). One that raises is
        logged and dropped (not run again); the loop goes on."""
        return self.call(lambda _: self._observers.append(fn))

    def unobserve(self, fn: Observer) -> Future[None]:
        return self.call(lambda _: self._observers.remove(fn) if fn in self._observers else None)

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
                    self._busy_since_s = None  # the snapshot just taken is the engine's state
                    while (
                        not self._stopping and not self._commands and not self.engine.has_unfinished_requests
                    ):
                        self._wake.wait()
                    if self._stopping:
                        break
                    self._busy_since_s = self.clock()
                    commands = list(self._commands)
                    self._commands.clear()
                if commands:
                    self._run_commands(commands)
                if self.engine.has_unfinished_requests:
                    self._step()
                    self._publish()
        except BaseException as exc:  # the engine is broken: fail everything loudly
            logger.exception("engine loop died")
            self.error = exc
        finally:
            self._fail_pending()

    def _run_commands(self, commands: list[tuple[Callable[[LLMEngine], Any], Future[Any]]]) -> None:
        """Run them, publish, then answer: once `call(fn)` resolves, `snapshot()` shows fn's effect
        (a reservation, an added request), which a drain or a Reserve reading it relies on."""
        outcomes: list[tuple[Future[Any], Any, BaseException | None]] = []
        for fn, future in commands:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                outcomes.append((future, fn(self.engine), None))
            except BaseException as exc:
                outcomes.append((future, None, exc))
        try:
            self._publish()
        finally:
            for future, result, error in outcomes:
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)

    def _step(self) -> None:
        for update in self.engine.step():
            callback = self._callbacks.get(update.request.request_id)
            if callback is not None:
                callback(update)
            if update.finished:
                self._callbacks.pop(update.request.request_id, None)

    def _publish(self) -> None:
        self._snapshot = EngineSnapshot.of(self.engine, self.clock())
        self._busy_since_s = self._snapshot.taken_s  # its age counts from here while busy
        with self._snapshot_taken:
            self._snapshot_taken.notify_all()
        for fn in list(self._observers):
            try:
                fn(self.engine)
            except Exception:  # an observer's bug must not stop the engine, nor log every step
                logger.exception("engine loop observer %r failed; it is no longer run", fn)
                self._observers.remove(fn)

    def _fail_pending(self) -> None:
        with self._wake:
            self._stopping = True
            pending = list(self._commands)
            self._commands.clear()
        with self._snapshot_taken:  # `wait_until` callers see the loop is gone
            self._snapshot_taken.notify_all()
        for _, future in pending:
            if not future.done():
                future.set_exception(RuntimeError("engine loop stopped"))
