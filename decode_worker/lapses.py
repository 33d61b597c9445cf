"""One thread that lapses every reservation of a decode worker whose Decode never came.

A reservation holds KV blocks and a state slot until its Decode call arrives or it is aborted.
If neither happens (the gateway died between Reserve and Decode), its room must come back on its
own. A timer thread per reservation did that, but lived for its whole deadline even after the
Decode came: at 500 requests in flight that is thousands of idle threads. Here a heap of deadlines
is served by one thread per servicer, started at the first reservation; `cancel` forgets an entry
at once (the heap is compacted once cancelled entries outnumber live ones, so it stays bounded by
the reservations actually pending).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class LapseReaper:
    """Owns the deadlines of pending reservations and the one thread that fires them.

    Promises: an entry's `callback` runs at most once, on the reaper's thread, no earlier than its
    deadline; not at all once `cancel(entry)` returned True or `close()` was called (a callback
    already running when `cancel` returns False may still be finishing: callbacks check their own
    state). Callbacks run one at a time; one that raises is logged and does not stop the others.
    """

    def __init__(self, name: str = "lapse-reaper") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []  # (monotonic deadline, entry id); may hold cancelled ids
        self._callbacks: dict[int, Callable[[], None]] = {}  # live entries only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def num_pending(self) -> int:
        """Entries that have neither fired nor been cancelled."""
        with self._cond:
            return len(self._callbacks)

    def add(self, delay_s: float, callback: Callable[[], None]) -> int:
        """Run `callback` in `delay_s` seconds unless cancelled first; returns the entry's id."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the lapse reaper is closed; no reservation can be taken")
            entry = next(self._ids)
            self._callbacks[entry] = callback
            heapq.heappush(self._heap, (time.monotonic() + delay_s, entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._heap[0][1] == entry:  # a new earliest deadline: the thread sleeps too long
                self._cond.notify()
            return entry

    def cancel(self, entry: int) -> bool:
        """Forget `entry`; returns whether it was still pending (False: it fired or was cancelled)."""
        with self._cond:
            if self._callbacks.pop(entry, None) is None:
                return False
            if len(self._heap) > 64 and len(self._heap) > 2 * len(self._callbacks):
                self._heap = [item for item in self._heap if item[1] in self._callbacks]
                heapq.heapify(self._heap)
            return True

    def close(self) -> None:
        """Fire nothing more and end the thread (waits for a callback in progress)."""
        with self._cond:
            self._closed = True
            self._callbacks.clear()
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                callback = self._next_due_locked()
                if callback is None:
                    return
            try:
                callback()
            except Exception:  # one reservation's cleanup must not stop the others' lapses
                logger.exception("a reservation's lapse failed")

    def _next_due_locked(self) -> Callable[[], None] | None:
        """Waits for the earliest live deadline; its callback (taken out), or None once closed."""
        while not self._closed:
            while self._heap and self._heap[0][1] not in self._callbacks:
                heapq.heappop(self._heap)  # cancelled
            if not self._heap:
                self._cond.wait()
                continue
            deadline, entry = self._heap[0]
            wait_s = deadline - time.monotonic()
            if wait_s > 0:
                self._cond.wait(wait_s)
                continue
            heapq.heappop(self._heap)
            return self._callbacks.pop(entry)
        return None
