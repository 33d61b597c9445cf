"""Admission of API requests, and draining them before the gateway stops.

While open, every generation request (completions, chat) is counted from its first byte in
to its last byte out, streams included. `close()` turns new ones away with a 503 and makes
`/health` say `draining`, so a load balancer moves on; `wait_idle()` then lets the requests
already admitted finish, up to a deadline. A rolling restart or a Ctrl-C so loses no request
that could finish within `drain_timeout_s`.
"""

from __future__ import annotations

import threading
import time

from starlette.responses import JSONResponse

from frontend.errors import error_body

GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


class Admission:
    """Owns the count of admitted generation requests and the open/closed flag.

    Thread-safe: the event loop admits and releases, another thread (the Ray actor's) closes
    and waits. Closing is one-way.
    """

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._num_in_flight = 0
        self._open = True

    @property
    def is_open(self) -> bool:
        return self._open

    def try_admit(self) -> bool:
        with self._idle:
            if not self._open:
                return False
            self._num_in_flight += 1
            return True

    def release(self) -> None:
        with self._idle:
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._idle.notify_all()

    def close(self) -> None:
        with self._idle:
            self._open = False

    def wait_idle(self, timeout_s: float) -> int:
        """Block until no admitted request is left or `timeout_s` passes; how many are left."""
        deadline_s = time.monotonic() + timeout_s
        with self._idle:
            while self._num_in_flight > 0:
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    break
                self._idle.wait(remaining_s)
            return self._num_in_flight


# The answer to a generation request once the gateway drains (frontend.front_door sends it).
DRAINING = JSONResponse(
    error_body(
        503, "the gateway is shutting down and takes no new requests; retry elsewhere", None, "draining"
    ),
    status_code=503,
    headers={"retry-after": "1"},
)
