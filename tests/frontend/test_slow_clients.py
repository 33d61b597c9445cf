"""Slow and idle clients cannot hold connections: real sockets against the real gateway under
uvicorn on 127.0.0.1, with short read deadlines. A connection that sends nothing, trickles its
headers, trickles or stops short in its body, or idles after a response is closed by the server
(a 408 in the error shape where a request had begun); a client address past its connection cap
gets a 429; a request that is not valid HTTP/1.1 gets the same JSON error body as every 400.

Each test waits for the server to close by reading the socket to its end, with a guard far above
the deadline under test: without the deadline, the guard is what ends the read, and the test fails.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pydantic import ValidationError

from frontend.http_protocol import ConnectionLimits
from frontend.settings import GatewaySettings
from splitserve.config import ConfigError, default_config, parse_config
from tests.frontend.conftest import Gateway, running_gateway
from tests.frontend.fakes import Script

HEADER_READ_TIMEOUT_S = 1.0
BODY_READ_TIMEOUT_S = 1.0
REQUEST_READ_TIMEOUT_S = 3.0
KEEP_ALIVE_TIMEOUT_S = 1.0
TRICKLE_EVERY_S = 0.2  # well inside every deadline but the one a test runs out
GUARD_S = 20.0  # the longest a test waits for the server to close
HEALTH = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Gateway]:
    with running_gateway(
        None,
        Script([5, 6, 7]),
        header_read_timeout_s=HEADER_READ_TIMEOUT_S,
        body_read_timeout_s=BODY_READ_TIMEOUT_S,
        request_read_timeout_s=REQUEST_READ_TIMEOUT_S,
        keep_alive_timeout_s=KEEP_ALIVE_TIMEOUT_S,
    ) as gw:
        yield gw


@contextlib.contextmanager
def connected(gateway: Gateway) -> Iterator[socket.socket]:
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GUARD_S)
    try:
        yield sock
    finally:
        sock.close()


def trickle_until_closed(sock: socket.socket, pieces: Iterator[bytes]) -> tuple[bytes, int]:
    """Send a piece every TRICKLE_EVERY_S until the server answers or closes; then everything it
    sent up to its close, and how many pieces went out. Fails past GUARD_S."""
    start_s, num_sent = time.monotonic(), 0
    for piece in pieces:
        try:
            sock.sendall(piece)
            num_sent += 1
        except OSError:  # the server closed while we wrote
            break
        readable, _, _ = select.select([sock], [], [], TRICKLE_EVERY_S)
        if readable:
            break
        assert time.monotonic() - start_s < GUARD_S, f"still open after {GUARD_S} s of trickling"
    return read_until_eof(sock), num_sent


def read_until_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; a failure if it is still open after GUARD_S."""
    chunks = []
    deadline_s = time.monotonic() + GUARD_S
    while True:
        sock.settimeout(max(0.01, deadline_s - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            pytest.fail(f"the server kept the connection open past {GUARD_S} s")
        except ConnectionResetError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def error_of(raw: bytes, status: int) -> dict:
    """The error object of a raw HTTP/1.1 response, checked to be a JSON error with `status`."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), raw[:300]
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    parsed = json.loads(body)
    assert set(parsed) == {"error"} and set(parsed["error"]) == {"message", "type", "param", "code"}
    return parsed["error"]


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(gateway: Gateway):
    with connected(gateway) as sock:
        assert read_until_eof(sock) == b""  # nothing was asked: closed without a word


def test_headers_sent_a_line_at_a_time_are_cut_off_with_a_408(gateway: Gateway):
    def lines() -> Iterator[bytes]:
        yield b"POST /v1/completions HTTP/1.1\r\n"
        for i in range(1000):
            yield b"X-Slow-%d: 1\r\n" % i

    with connected(gateway) as sock:
        raw, num_sent = trickle_until_closed(sock, lines())
    error = error_of(raw, 408)
    assert "gateway.header_read_timeout_s" in error["message"] and error["code"] == 408
    assert num_sent >= 3  # the client was sending all along: a deadline on the whole head, not a gap


def test_a_chunked_body_a_byte_at_a_time_is_cut_off_at_the_request_deadline(gateway: Gateway):
    def body() -> Iterator[bytes]:
        yield b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        yield b"Transfer-Encoding: chunked\r\n\r\n"
        while True:
            yield b"1\r\n \r\n"

    with connected(gateway) as sock:
        raw, num_sent = trickle_until_closed(sock, body())
    error = error_of(raw, 408)
    assert "gateway.request_read_timeout_s" in error["message"]
    assert num_sent * TRICKLE_EVERY_S >= BODY_READ_TIMEOUT_S  # no gap was as long as the body's limit


def test_a_body_shorter_than_its_content_length_is_cut_off_when_it_falls_silent(gateway: Gateway):
    with connected(gateway) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"prompt": '
        )
        raw = read_until_eof(sock)
    error = error_of(raw, 408)
    assert "gateway.body_read_timeout_s" in error["message"]


def test_a_connection_idle_after_its_response_is_closed_after_the_keep_alive_timeout(gateway: Gateway):
    with connected(gateway) as sock:
        sock.sendall(HEALTH)
        raw = read_until_eof(sock)
    assert raw.startswith(b"HTTP/1.1 200 ") and raw.count(b"HTTP/1.1") == 1  # the answer, then a quiet close


def test_a_connection_kept_busy_is_not_closed_as_idle(gateway: Gateway):
    """Requests spaced well inside the keep-alive timeout, for longer than every deadline: the
    connection serves them all (idleness counts from the last answer, not from the opening)."""
    with connected(gateway) as sock:
        for _ in range(round(3 * (HEADER_READ_TIMEOUT_S + KEEP_ALIVE_TIMEOUT_S) / TRICKLE_EVERY_S)):
            sock.sendall(HEALTH)
            assert read_one_response(sock).startswith(b"HTTP/1.1 200 ")
            readable, _, _ = select.select([sock], [], [], TRICKLE_EVERY_S)  # the server says nothing
            assert not readable, "the server closed a connection in use"


def read_one_response(sock: socket.socket) -> bytes:
    """One whole response (headers and a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_request_the_app_takes_long_to_answer_is_not_cut_off(gateway: Gateway):
    """Deadlines bound reading a request, not the app's work on it."""
    gateway.decode.hold_reserve = hold = threading.Event()
    num_reserves = len(gateway.decode.reserves)
    try:
        with ThreadPoolExecutor(1) as pool, gateway.http() as http:
            answer = pool.submit(http.post, "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert _poll(lambda: len(gateway.decode.reserves) > num_reserves), (
                "the request never reached a worker"
            )
            with connected(gateway) as probe:  # opened later, it runs out its header deadline meanwhile
                assert read_until_eof(probe) == b""
            hold.set()
            response = answer.result(timeout=GUARD_S)
    finally:
        gateway.decode.hold_reserve = None
        hold.set()
    assert response.status_code == 200, response.text


def _poll(condition: Callable[[], bool]) -> bool:
    deadline_s = time.monotonic() + GUARD_S
    while not condition():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize(
    ("framing", "reason"),
    [
        (b"Content-Length: 5\r\nContent-Length: 6\r\n", "conflicting Content-Length"),
        (b"Content-Length: -1\r\n", "bad Content-Length"),
        (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "illegal chunk header"),
    ],
)
def test_a_request_with_bad_framing_gets_the_json_error_body(gateway: Gateway, framing: bytes, reason: str):
    request = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" + framing
    with connected(gateway) as sock:
        sock.sendall(request if framing.endswith(b"zz\r\n") else request + b"\r\n")
        raw = read_until_eof(sock)
    error = error_of(raw, 400)
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert reason in error["message"] and "not valid HTTP/1.1" in error["message"]
    with gateway.http() as http:  # counted with the other refusals
        assert 'reason="invalid_http"' in http.get("/metrics").text


def test_a_client_address_past_its_connection_cap_gets_a_429(tiny_model_path: Path):
    cap = 3
    with (
        running_gateway(None, Script([5]), max_connections_per_client=cap) as gateway,
        contextlib.ExitStack() as stack,
    ):
        held = [stack.enter_context(connected(gateway)) for _ in range(cap)]
        with connected(gateway) as refused:
            error = error_of(read_until_eof(refused), 429)
        assert (
            error["code"] == "too_many_connections"
            and "gateway.max_connections_per_client" in error["message"]
        )
        held[0].sendall(HEALTH)  # the held connections are served
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200 ")
        held[1].close()
        assert _served_once_a_connection_frees(gateway)


def test_with_several_gateway_processes_each_holds_a_client_to_its_share_of_the_cap(tiny_model_path: Path):
    # 5 over 2 processes: 2 each, so the two together never hold more than the deployment's 5
    with (
        running_gateway(None, Script([5]), max_connections_per_client=5, num_gateways=2) as gateway,
        contextlib.ExitStack() as stack,
    ):
        for _ in range(2):
            stack.enter_context(connected(gateway))
        with connected(gateway) as refused:
            error = error_of(read_until_eof(refused), 429)
    assert "holds 2 open connections" in error["message"]
    assert "share of gateway.max_connections_per_client (5) over its 2 processes" in error["message"]


def _served_once_a_connection_frees(gateway: Gateway) -> bool:
    """A new connection is served once the server has seen one of the held ones close."""
    deadline_s = time.monotonic() + GUARD_S
    while time.monotonic() < deadline_s:
        with connected(gateway) as sock:
            sock.sendall(HEALTH)
            if read_until_first_line(sock).startswith(b"HTTP/1.1 200 "):
                return True
    return False


def read_until_first_line(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("header_read_timeout_s", 0),
        ("body_read_timeout_s", -1),
        ("request_read_timeout_s", "soon"),
        ("keep_alive_timeout_s", 0),
        ("max_connections_per_client", 0),
    ],
)
def test_a_bad_connection_limit_is_one_clear_config_error(key: str, value: object):
    with pytest.raises(ConfigError, match=f"gateway.{key}"):
        parse_config({"gateway": {key: value}})
    with pytest.raises(ValidationError, match=key):
        GatewaySettings(**{key: value})


def test_the_connection_limits_are_listed_with_the_default_config():
    listed = default_config().to_yaml()
    for key in ConnectionLimits.__dataclass_fields__.keys() - {"num_gateways"}:  # that one is derived
        assert f"  {key}: " in listed
