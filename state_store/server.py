"""A running StateStore gRPC server: servicer + health service + a lease reaper, on one port."""

from __future__ import annotations

import threading

from splitserve import rpc
from splitserve.v1 import store_pb2_grpc
from state_store.servicer import SERVICE_NAME, StateStoreServicer
from state_store.store import StateStore


class StateStoreServer:
    """Serves `store` on host:port (port 0 = any free port; `address` names the one bound).

    Owns the gRPC server and a reaper thread that expires leases every `reap_interval_s`, so
    readers waiting on an abandoned key are woken even when nothing else calls the store. Does
    not own the store: `stop` leaves it open (the caller closes it). Answers grpc.health.v1 for
    "" and "splitserve.v1.StateStore".
    """

    def __init__(
        self,
        store: StateStore,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise_host: str | None = None,
        max_workers: int = rpc.DEFAULT_MAX_WORKERS,
        max_message_bytes: int = rpc.MAX_MESSAGE_BYTES,
        reap_interval_s: float = 1.0,
    ) -> None:
        self.store = store
        self._server = rpc.make_server(max_workers, max_message_bytes)
        store_pb2_grpc.add_StateStoreServicer_to_server(StateStoreServicer(store), self._server)
        self._health = rpc.add_health(self._server, [SERVICE_NAME])
        self.port = rpc.bind(self._server, host, port)
        self.address = rpc.format_address(advertise_host or host, self.port)
        self._stopping = threading.Event()
        self._reaper = threading.Thread(
            target=self._reap, args=(reap_interval_s,), name="state-store-reaper", daemon=True
        )
        self._server.start()
        self._reaper.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving (in-flight RPCs get `grace_s`, then are cancelled) and the reaper. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        self._reaper.join()

    def __enter__(self) -> StateStoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _reap(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            self.store.expire()
