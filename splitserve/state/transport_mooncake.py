"""Mooncake Transfer Engine behind `splitserve.state.transport` (the `mooncake` extra).

Peer-to-peer handshake (no metadata server): each side's engine listens on its host, and a
reader names a store by the "host:port" its engine listens on. The protocol is TCP unless
`SPLITSERVE_MOONCAKE_PROTOCOL` says otherwise (`rdma` with `SPLITSERVE_MOONCAKE_DEVICE`, e.g.
"mlx5_0", on clusters with RDMA NICs; only TCP on loopback is measured here). The engine's wheel
imports only where libibverbs is present; `load_engine` says what to install when it is not.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Any

from splitserve.state.errors import StateUnavailableError
from splitserve.state.transport import TransportEndpoint

ENGINE = "mooncake"
PROTOCOL_ENV = "SPLITSERVE_MOONCAKE_PROTOCOL"
DEVICE_ENV = "SPLITSERVE_MOONCAKE_DEVICE"
INSTALL_HINT = (
    "the mooncake transfer engine is not usable here: install the extra "
    "(pip install 'splitserve[mooncake]' on CUDA nodes, 'splitserve[mooncake-cpu]' elsewhere) and "
    "libibverbs (apt-get install libibverbs1 librdmacm1), or set store.transfer_engine: none"
)


def load_engine() -> Any:
    """A fresh, uninitialised `mooncake.engine.TransferEngine`; ImportError naming the extra and
    libibverbs when the wheel or a library it links is missing."""
    os.environ.setdefault("GLOG_minloglevel", "1")  # the engine logs every connection at INFO
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return TransferEngine()


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte (the engine registers raw memory)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class _Engine:
    """One initialised engine listening on `host`; its "host:port" is `address`."""

    def __init__(self, host: str) -> None:
        self.engine = load_engine()
        protocol = os.environ.get(PROTOCOL_ENV, "tcp")
        device = os.environ.get(DEVICE_ENV, "")
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise StateUnavailableError(
                f"the mooncake transfer engine did not start on {host} over {protocol!r} "
                f"(device {device!r}); check {PROTOCOL_ENV}/{DEVICE_ENV} and the host's address"
            )
        self.address = f"{host}:{self.engine.get_rpc_port()}"


class MooncakeServer:
    """A store's memory served to remote readers. Owns its engine (it stops with the process:
    the engine has no stop call) and the registrations. Thread-safe."""

    def __init__(self, host: str) -> None:
        self._engine = _Engine(host)
        self.endpoint = TransportEndpoint(ENGINE, self._engine.address)
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> num_bytes

    def register(self, view: memoryview) -> int:
        address = address_of(view)
        with self._lock:
            if self._engine.engine.register_memory(address, view.nbytes) != 0:
                raise StateUnavailableError(
                    f"mooncake could not register {view.nbytes} bytes at {address:#x}"
                )
            self._registered[address] = view.nbytes
        return address

    def unregister(self, address: int) -> None:
        with self._lock:
            if self._registered.pop(address, None) is not None:
                self._engine.engine.unregister_memory(address)

    def close(self) -> None:
        with self._lock:
            for address in list(self._registered):
                self._engine.engine.unregister_memory(address)
            self._registered.clear()


class MooncakeClient:
    """A reader's engine: each read lands in a fresh anonymous mapping, registered for the copy
    (RDMA needs both sides registered; TCP does not mind) and handed out as a memoryview."""

    engine = ENGINE

    def __init__(self, host: str) -> None:
        self._engine = _Engine(host)
        self.address = self._engine.address

    def read(self, endpoint: str, address: int, num_bytes: int) -> memoryview:
        if num_bytes == 0:
            return memoryview(b"")
        buffer = mmap.mmap(-1, num_bytes)
        local = address_of(memoryview(buffer))
        engine = self._engine.engine
        if engine.register_memory(local, num_bytes) != 0:
            raise StateUnavailableError(f"mooncake could not register a {num_bytes}-byte receive buffer")
        try:
            status = engine.transfer_sync_read(endpoint, local, address, num_bytes)
        finally:
            engine.unregister_memory(local)
        if status != 0:
            raise StateUnavailableError(
                f"mooncake read of {num_bytes} bytes at {address:#x} from the store at {endpoint} failed "
                f"(status {status}): its region was released, or the store is gone or unreachable"
            )
        return memoryview(buffer).toreadonly()

    def close(self) -> None:
        """Nothing to free: the engine stops with the process."""
