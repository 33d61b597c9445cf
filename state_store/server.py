"""A running StateStore gRPC server: servicer + health service + a lease reaper, on one port."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve import rpc
from splitserve.v1 import store_pb2_grpc
from state_store.servicer import SERVICE_NAME, StateStoreServicer
from state_store.store import StateStore

STORE_CALL_THREADS = 8  # threads for store calls that touch bytes; waiting reads hold none


class StateStoreServer:
    """Serves `store` on host:port (port 0 = any free port; `address` names the one bound).

    Owns a grpc.aio server on its own event-loop thread (so waiting reads park no thread), the
    small pool its store calls run on (`max_workers` threads), and a reaper thread that expires
    leases every `reap_interval_s`, so readers waiting on an abandoned key are woken even when
    nothing else calls the store. Does not own the store: `stop` leaves it open (the caller
    closes it). Answers grpc.health.v1 for "" and "splitserve.v1.StateStore".
    """

    def __init__(
        self,
        store: StateStore,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        max_workers: int = STORE_CALL_THREADS,
        max_message_bytes: int = rpc.MAX_MESSAGE_BYTES,
        reap_interval_s: float = 1.0,
    ) -> None:
        self.store = store
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="state-store-call")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="state-store-grpc", daemon=True)
        self._loop_thread.start()
        self._health = health.aio.HealthServicer()
        self._server = self._on_loop(self._start(max_message_bytes))
        try:
            self.port = rpc.bind(self._server, host, port)  # type: ignore[arg-type]
            self._on_loop(self._server.start())
        except BaseException:
            self._shut_loop()
            raise
        self.address = rpc.format_address(advertise_host or host, self.port)
        if store.arena is not None:  # a transfer engine (if configured) listens where readers reach
            try:
                store.arena.serve_remote(advertise_host or host)
            except BaseException:
                self._on_loop(self._stop(0))
                self._shut_loop()
                raise
        self._stopping = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap, args=(reap_interval_s,), name="state-store-reaper", daemon=True
        )
        self._reaper.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving (in-flight RPCs get `grace_s`, then are cancelled) and the reaper. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._on_loop(self._stop(grace_s))
        self._shut_loop()
        self._reaper.join()

    def __enter__(self) -> StateStoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _start(self, max_message_bytes: int) -> grpc.aio.Server:
        server = grpc.aio.server(
            options=rpc.server_options(max_message_bytes), interceptors=rpc.aio_server_interceptors()
        )
        store_pb2_grpc.add_StateStoreServicer_to_server(StateStoreServicer(self.store, self._executor), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return server

    async def _stop(self, grace_s: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)

    def _on_loop(self, coroutine):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _shut_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _reap(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            self.store.expire()
