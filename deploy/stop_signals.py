"""SIGINT and SIGTERM as something a foreground process can wait on without a lock.

A signal handler runs on the main thread between two bytecodes, wherever that thread is. One
that calls `threading.Event.set()` deadlocks when a second signal lands while the first
handler is inside `set()`: the second handler waits for the lock the first one holds, on the
same thread. Ctrl-C pressed twice, or `timeout` relaying a signal that `pkill` also sent, did
exactly that to `splitserve up`. Here the handlers do nothing; `signal.set_wakeup_fd` has the
interpreter write each signal's number to a socket, and waiting is a `select` on that socket.
"""

from __future__ import annotations

import select
import signal
import socket
from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _ignore(signum: int, frame: FrameType | None) -> None:
    """A handler that touches nothing; the wakeup socket records the signal."""


class StopSignals:
    """Owns the SIGINT/SIGTERM handlers and the signal wakeup fd while entered (main thread only).

    `wait(timeout_s)` returns True once either signal has arrived (and keeps returning True);
    more signals after the first change nothing. On exit the previous handlers and wakeup fd
    are put back.
    """

    def __init__(self) -> None:
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._previous_handlers: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._received = False

    def __enter__(self) -> StopSignals:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._previous_handlers = {sig: signal.signal(sig, _ignore) for sig in STOP_SIGNALS}
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        return self

    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` for a stop signal; True once one has come."""
        assert self._reader is not None, "wait() outside the with-block"
        if not self._received and select.select([self._reader], [], [], timeout_s)[0]:
            self._received = True
        return self._received

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        for sock in (self._reader, self._writer):
            if sock is not None:
                sock.close()
        self._reader = self._writer = None
