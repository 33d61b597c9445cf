"""uvicorn's HTTP/1.1 protocol (h11) with the bounds it lacks against slow and idle clients, and
the gateway's error body on what never reaches the app.

* Read deadlines. A request's line and headers must arrive within `header_read_timeout_s` of its
  first byte (a new connection's first request: of the connection's opening, so a connection
  that sends nothing is closed after it); a body may fall silent for at most
  `body_read_timeout_s`; the whole request must arrive within `request_read_timeout_s`. Past one,
  a 408 and the connection is closed. A connection idle between requests is closed after
  `keep_alive_timeout_s` (uvicorn's own keep-alive timer, given that value). A request read whole
  is the app's: no read deadline runs while it works or streams its answer.
* A cap on the connections one client address holds open: past it, a new connection gets a 429
  and is closed (after reading out what the client sent, so the client sees the answer). The cap
  is the deployment's: with several gateway processes each holds one address to its share
  (`ConnectionLimits.per_process_cap`), so together they never admit more than the cap.
* A request that is not valid HTTP/1.1 (two Content-Lengths, a negative one, a broken chunk) is
  answered in the OpenAI error shape, not with uvicorn's plain text.

On the fast path this costs no timer work per read: a read moves a timestamp (a request read
whole in one read does nothing more), and each connection has at most one timer pending, which on
firing works out the deadline in force from the timestamps and the parser's state, and sleeps
again if it has not passed. `experiments/http_protocol_overhead.py` measures the CPU per request
against uvicorn's own protocol: the same within its noise.
"""

from __future__ import annotations

import asyncio
import collections
import http
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from frontend.errors import ErrorJSONResponse, error_body
from frontend.settings import GatewaySettings

REFUSED_LINGER_S = 1.0  # how long a refused connection is read out before it is closed
MAX_REASON_CHARS = 200  # of h11's description of a malformed request, in the 400's message
_IDLE = "idle"  # a connection between requests, nothing of the next one read: closed without a word
# What each read deadline's 408 says; `{}` is the limit in seconds.
_TIMED_OUT = {
    "header_read_timeout_s": "the request line and headers did not arrive within {:g} s",
    "body_read_timeout_s": "no part of the request body arrived for {:g} s",
    "request_read_timeout_s": "the request did not arrive whole within {:g} s",
}


@dataclass(frozen=True)
class ConnectionLimits:
    """The read deadlines and the per-client connection cap (the `gateway.*` keys of those names)."""

    header_read_timeout_s: float
    body_read_timeout_s: float
    request_read_timeout_s: float
    keep_alive_timeout_s: float
    max_connections_per_client: int | None  # the deployment's, over all its gateway processes
    num_gateways: int = 1  # gateway processes sharing that cap

    @classmethod
    def of(cls, settings: GatewaySettings) -> ConnectionLimits:
        return cls(
            settings.header_read_timeout_s,
            settings.body_read_timeout_s,
            settings.request_read_timeout_s,
            settings.keep_alive_timeout_s,
            settings.max_connections_per_client,
            settings.num_gateways,
        )

    @property
    def per_process_cap(self) -> int | None:
        """Connections one address may hold to this process: its even share of the cap (at least 1)."""
        cap = self.max_connections_per_client
        return None if cap is None else max(1, cap // self.num_gateways)


class ClientConnections:
    """Owns the count of open connections per client address, and admits one only under the cap."""

    def __init__(self, max_per_client: int | None) -> None:
        self.max_per_client = max_per_client
        self._open: collections.Counter[str] = collections.Counter()

    def admit(self, host: str) -> bool:
        if self.max_per_client is not None and self._open[host] >= self.max_per_client:
            return False
        self._open[host] += 1
        return True

    def release(self, host: str) -> None:
        self._open[host] -= 1
        if self._open[host] <= 0:
            del self._open[host]

    def num_open(self, host: str) -> int:
        return self._open.get(host, 0)


class GatewayHTTPConfig(uvicorn.Config):
    """uvicorn's config, serving with `GatewayH11Protocol` under `limits`; `on_refusal(reason)`
    is told of each connection or request the protocol turns away."""

    def __init__(
        self,
        app: Any,
        limits: ConnectionLimits,
        on_refusal: Callable[[str], None] = lambda reason: None,
        **kwargs: Any,
    ) -> None:
        # after an answer, uvicorn's own keep-alive timer closes an idle connection (it takes seconds
        # as a float too); ours takes over once a byte of the next request arrives
        keep_alive_s: Any = limits.keep_alive_timeout_s
        super().__init__(app, http=GatewayH11Protocol, timeout_keep_alive=keep_alive_s, **kwargs)
        self.limits = limits
        self.clients = ClientConnections(limits.per_process_cap)
        self.on_refusal = on_refusal


class GatewayH11Protocol(H11Protocol):
    """One client connection: uvicorn's h11 protocol plus read deadlines, the per-client cap and
    JSON errors for malformed requests. Needs a `GatewayHTTPConfig`."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, GatewayHTTPConfig), "serve GatewayH11Protocol with a GatewayHTTPConfig"
        self.limits = config.limits
        self.clients = config.clients
        self.on_refusal = config.on_refusal
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s = math.inf
        self._idle_since_s = 0.0  # the connection's opening, or the end of its last answer
        self._request_start_s = 0.0  # the first byte of the request being read
        self._last_read_s = 0.0
        self._head_started = False  # bytes of the next request's head have arrived
        self._refused = False
        self._counted_host: str | None = None  # the address this connection counts against

    # The connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else None  # None on a Unix socket: no cap
        if host is not None:
            if not self.clients.admit(host):
                self._refuse_connection()
                return
            self._counted_host = host
        self._idle_since_s = self.loop.time()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counted_host is not None:
            self.clients.release(self._counted_host)
            self._counted_host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # what the client of a refused connection sends is read and dropped
        conn = self.conn
        self._last_read_s = now = self.loop.time()
        if not self._head_started and conn.their_state is h11.IDLE:
            self._head_started = True
            self._request_start_s = now
        super().data_received(data)
        state = conn.their_state
        if state is h11.DONE:  # read whole (the common case, in one read): the app's until answered
            self._head_started = False
            return
        if state is not h11.IDLE:
            self._head_started = False  # the head is in; the body is being read
        elif not self._head_started:  # a body that came in after its answer just ended: idle now
            self._idle_since_s = now
        self._arm()

    def on_response_complete(self) -> None:
        self._idle_since_s = self.loop.time()  # a pending timer then counts idleness from here
        super().on_response_complete()

    # Read deadlines --------------------------------------------------------------------------

    def _read_deadline(self) -> tuple[float, str] | None:
        """When the read under way times out, and the key of the limit that ends it (`_IDLE`
        between requests); None while the app has the request (read whole, not yet answered)."""
        limits, state = self.limits, self.conn.their_state
        whole = (self._request_start_s + limits.request_read_timeout_s, "request_read_timeout_s")
        if state is h11.SEND_BODY:
            return min((self._last_read_s + limits.body_read_timeout_s, "body_read_timeout_s"), whole)
        if state is not h11.IDLE or (self.cycle is not None and not self.cycle.response_complete):
            return None
        if self._head_started:
            return min((self._request_start_s + limits.header_read_timeout_s, "header_read_timeout_s"), whole)
        idle_s = limits.keep_alive_timeout_s if self.cycle is not None else limits.header_read_timeout_s
        return self._idle_since_s + idle_s, _IDLE

    def _arm(self) -> None:
        """Make sure a timer fires no later than the deadline in force (one timer at most)."""
        found = self._read_deadline()
        if found is None or found[0] >= self._timer_at_s:
            return  # nothing to wait for, or the pending timer comes first and will look again
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at_s = found[0]
        self._timer = self.loop.call_at(found[0], self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at_s = None, math.inf
        if self.transport.is_closing():
            return
        found = self._read_deadline()
        if found is None:
            return  # the app has the request; after its answer, uvicorn's keep-alive timer
        deadline_s, key = found
        if deadline_s - self.loop.time() > 0.001:  # the client moved on since: wait again
            self._arm()
        elif key == _IDLE:  # nothing asked, nothing to answer
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()
        else:
            self.on_refusal("read_timeout")
            what = _TIMED_OUT[key].format(getattr(self.limits, key))
            self._answer_and_close(408, f"{what} (gateway.{key}); send each request whole and promptly")

    # Refusals the app never sees ---------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in the gateway's error shape. uvicorn
        calls it while handling h11's error, which therefore says what was wrong."""
        error = sys.exc_info()[1]
        if not isinstance(error, h11.RemoteProtocolError):
            error = None
        status = error.error_status_hint if error is not None else 400
        reason = str(error) if error is not None else msg
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS] + "..."
        self.on_refusal("invalid_http")
        self._answer_and_close(
            status,
            f"the request is not valid HTTP/1.1: {reason}; send one request line, well-formed headers "
            "and one body framing (a single Content-Length that matches the body, or "
            "Transfer-Encoding: chunked)",
        )

    def _refuse_connection(self) -> None:
        self._refused = True
        self.on_refusal("too_many_connections")
        limits = self.limits
        if limits.num_gateways > 1:
            most = (
                f"this gateway process's share of gateway.max_connections_per_client "
                f"({limits.max_connections_per_client}) over its {limits.num_gateways} processes"
            )
        else:
            most = "the most one address may (gateway.max_connections_per_client)"
        message = (
            f"this client address already holds {self.clients.max_per_client} open connections, {most}; "
            "reuse or close some, then retry"
        )
        self._write_error(429, message, "too_many_connections", {"retry-after": "1"})
        if self.transport.can_write_eof():  # read out the request, then close: the client sees no reset
            self.transport.write_eof()
            self._timer = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _answer_and_close(self, status: int, message: str) -> None:
        """Answer with an error (unless an answer has started: then only close) and close."""
        if self.cycle is None or not self.cycle.response_started or self.cycle.response_complete:
            self._write_error(status, message)
        self.transport.close()

    def _write_error(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Write one error response straight to the socket, whatever state h11 is in: the
        connection is closed right after, so the parser's view of it no longer matters."""
        headers = {**(headers or {}), "connection": "close"}
        response = ErrorJSONResponse(
            error_body(status, message, code=code), status_code=status, headers=headers
        )
        lines = [b"HTTP/1.1 %d %s" % (status, http.HTTPStatus(status).phrase.encode())]
        for name, value in [*self.server_state.default_headers, *response.raw_headers]:
            lines.append(name + b": " + value)
        self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + response.body)
