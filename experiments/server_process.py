"""A server in a child process: spawned, asked for its address, told to stop.

A benchmark that runs the thing it measures and the clients measuring it in one interpreter
measures their fight for one GIL as well. `ServerProcess` runs a server in its own process
instead, as it runs in production. Its target is a module-level function `target(conn, *args)`
that starts serving, sends its address through `conn`, then calls `wait_until_told(conn)` and
stops.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds process `pid` (None: this one) has used, all threads; NaN
    where /proc cannot say (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def wait_until_told(conn: Connection) -> None:
    """Block until the parent says stop or goes away (the pipe closes)."""
    with contextlib.suppress(EOFError):
        conn.recv()


class ServerProcess:
    """Owns one spawned child process serving something; a context manager that stops it."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        self.target = target
        self.args = args
        self.name = name
        self.address = ""
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None

    def start(self, timeout_s: float = 120.0) -> str:
        """Spawn the child and wait until it says where it serves; returns that address."""
        ctx = multiprocessing.get_context("spawn")  # forking a process with gRPC threads is unsafe
        parent, child = ctx.Pipe()
        self._conn = parent
        self._process = ctx.Process(target=self.target, args=(child, *self.args), name=self.name, daemon=True)
        self._process.start()
        child.close()
        ready = parent.poll(timeout_s)
        try:
            address = parent.recv() if ready else None
        except EOFError:  # the child died before it said anything
            address = None
        if not isinstance(address, str):
            process = self._process
            process.join(5.0 if ready else 0.0)
            self.stop()
            why = f"exited with code {process.exitcode}" if ready else f"said nothing in {timeout_s:g} s"
            raise RuntimeError(f"{self.name} did not start: its process {why}; its stderr says why")
        self.address = address
        return address

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def cpu_seconds(self) -> float:
        """CPU seconds the child has used so far (see `cpu_seconds`); NaN when not running."""
        pid = self.pid
        return cpu_seconds(pid) if pid is not None else math.nan

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the child to stop and wait for it; kill it if it will not. Idempotent."""
        conn, process, self._conn, self._process = self._conn, self._process, None, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send("stop")
            conn.close()
        if process is not None:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()
                process.join(timeout_s)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
