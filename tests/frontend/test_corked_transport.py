"""CorkedTransport (frontend/http_protocol.py): one write per turn of the loop, none lost on close."""

from __future__ import annotations

import asyncio

from frontend.http_protocol import CorkedTransport


class RecordingTransport:
    """What a transport was asked to do, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", data))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


def _corked() -> tuple[CorkedTransport, RecordingTransport]:
    raw = RecordingTransport()
    return CorkedTransport(raw, asyncio.get_running_loop()), raw  # type: ignore[arg-type]


def test_writes_of_one_turn_leave_as_one():
    async def main() -> list[tuple[str, bytes]]:
        corked, raw = _corked()
        for part in (b"HTTP/1.1 200 OK\r\n\r\n", b"", b"5\r\nhello\r\n", b"0\r\n\r\n"):
            corked.write(part)
        assert raw.calls == []  # nothing yet: the turn is not over
        await asyncio.sleep(0)
        corked.write(b"next turn")
        await asyncio.sleep(0)
        return raw.calls

    assert asyncio.run(main()) == [
        ("write", b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
        ("write", b"next turn"),
    ]


def test_close_sends_what_is_pending_first_and_nothing_after():
    async def main() -> tuple[list[tuple[str, bytes]], str]:
        corked, raw = _corked()
        corked.write(b"the answer")
        corked.close()
        corked.write(b"too late")
        await asyncio.sleep(0)
        return raw.calls, corked.get_extra_info("peername")

    calls, info = asyncio.run(main())
    assert calls == [("write", b"the answer"), ("close", b"")]
    assert info == "info:peername"  # the rest is the transport's own
