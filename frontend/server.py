"""Runs the gateway app under uvicorn on a background thread, startable and stoppable in-process.

Used by the Ray actor and by tests: `start()` returns once the socket is bound (port 0 picks a
free port; `address` says which), `stop()` returns once the server has shut down. The socket is
bound here, before uvicorn runs, so a port that is taken is one clear error raised by `start()`
(uvicorn would log it and exit its thread with a bare status code). Connections are served by
`frontend.http_protocol` under the app's settings (`build_app` leaves them in `app.state.settings`):
read deadlines, the per-client connection cap, JSON errors for malformed requests.

A server that owns its process (`freeze_heap`: the Ray actor's) moves every object alive once it
serves into the collector's permanent generation (`gc.freeze`): the app, its routes, schemas and
the libraries are then never traversed again by the collections that the garbage of each request
triggers, about 50 us of CPU a request here; `stop()` hands them back to the collector.

A `shared` server is one of several gateway processes on one port: its socket sets SO_REUSEPORT
(the kernel spreads new connections over every process listening there; each process bound by
the same user), and it also listens on a port of its own (`own_address`), where its `/metrics`
and `/health` are its own, whichever process the shared port would pick.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import socket
import threading

import uvicorn
from fastapi import FastAPI

from frontend.http_protocol import ConnectionLimits, GatewayHTTPConfig
from frontend.settings import GatewaySettings


class _Server(uvicorn.Server):
    """uvicorn's server, telling a thread when its sockets are bound."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.bound = threading.Event()

    def install_signal_handlers(self) -> None:  # not the main thread; the owner stops us
        pass

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        try:
            await super().startup(sockets)
        finally:
            self.bound.set()


class GatewayBindError(RuntimeError):
    """The gateway could not listen on its configured host and port."""


def bind_listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to host:port (port 0: any free one), or a GatewayBindError saying why.
    With `reuse_port`, other sockets that set it too (other gateway processes) may bind it as well."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise GatewayBindError(f"gateway.host {host!r} does not resolve: {exc.strerror}") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        taken = "another process is listening there" + (" without sharing the port" if reuse_port else "")
        hint = {
            errno.EADDRINUSE: f"{taken}; stop it or set gateway.port",
            errno.EADDRNOTAVAIL: "no interface on this node has that address; set gateway.host",
            errno.EACCES: "ports below 1024 need privileges; set gateway.port above 1023",
        }.get(exc.errno or 0, "set gateway.host and gateway.port")
        raise GatewayBindError(f"gateway cannot listen on {host}:{port}: {exc.strerror} ({hint})") from exc
    return sock


class GatewayServer:
    """Owns one uvicorn server and the thread running its event loop.

    `limits` bound slow and idle clients; by default, those of the app's settings (or the
    settings' defaults, for an app without them). `shared`: the port is shared with other gateway
    processes, and this one also listens on a port of its own (`own_address`). `freeze_heap`:
    this server is what its process is for; freeze what is alive once it serves (`gc.freeze`)."""

    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ConnectionLimits | None = None,
        shared: bool = False,
        freeze_heap: bool = False,
    ) -> None:
        self.app = app
        self.freeze_heap = freeze_heap
        self.host = host
        self.port = port
        self.shared = shared
        self.own_port: int | None = None
        settings = getattr(app.state, "settings", None)
        self.limits = limits or ConnectionLimits.of(
            settings if isinstance(settings, GatewaySettings) else GatewaySettings.model_validate({})
        )
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        """host:port actually bound (the shared port, for a shared server)."""
        return f"{self.host}:{self.port}"

    @property
    def own_address(self) -> str:
        """host:port this process alone listens on: its own port when shared, else `address`."""
        return f"{self.host}:{self.own_port}" if self.own_port is not None else self.address

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self, timeout_s: float = 30.0) -> str:
        if self._thread is not None:
            raise RuntimeError(f"gateway already running on {self.address}")
        sockets = [bind_listening_socket(self.host, self.port, reuse_port=self.shared)]
        if self.shared:
            try:
                sockets.append(bind_listening_socket(self.host, 0))
            except GatewayBindError:
                sockets[0].close()
                raise
        on_refusal = getattr(self.app.state, "on_refusal", lambda reason: None)
        config = GatewayHTTPConfig(
            self.app,
            self.limits,
            on_refusal,
            host=self.host,
            port=self.port,
            log_level="warning",
            lifespan="on",
        )
        self._server = server = _Server(config)
        self._thread = threading.Thread(
            target=self._run, args=(sockets,), name="gateway-uvicorn", daemon=True
        )
        self._thread.start()
        if not server.bound.wait(timeout_s):
            raise TimeoutError(f"gateway did not start on {self.host}:{self.port} within {timeout_s:g} s")
        if not server.started:
            self.stop()
            for sock in sockets:
                sock.close()
            reason = "its startup failed" if isinstance(self._error, SystemExit) else repr(self._error)
            raise RuntimeError(f"gateway failed to start on {self.host}:{self.port}: {reason}")
        self.port = sockets[0].getsockname()[1]
        if self.shared:
            self.own_port = sockets[1].getsockname()[1]
        if self.freeze_heap:
            gc.collect()
            gc.freeze()
        return self.address

    def _run(self, sockets: list[socket.socket]) -> None:
        assert self._server is not None
        try:
            asyncio.run(self._server.serve(sockets=sockets))
        except BaseException as exc:  # reported by start(); a thread has nowhere else to put it
            self._error = exc
        finally:
            self._server.bound.set()

    def stop(self, grace_s: float = 30.0, timeout_s: float = 30.0) -> None:
        """Stop listening; give open connections `grace_s` to finish (uvicorn's graceful
        shutdown), then force them closed, cancelling their requests; wait up to `timeout_s` more."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        if grace_s > 0:
            thread.join(grace_s)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout_s)
        self._server = self._thread = None
        if self.freeze_heap:
            gc.unfreeze()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
