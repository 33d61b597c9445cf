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
import weakref
from typing import Any

import numpy as np

from splitserve.state.errors import StateUnavailableError
from splitserve.state.transport import TransportEndpoint

ENGINE = "mooncake"
PROTOCOL_ENV = "SPLITSERVE_MOONCAKE_PROTOCOL"
DEVICE_ENV = "SPLITSERVE_MOONCAKE_DEVICE"
RECEIVE_SLAB_BYTES = 64 << 20  # a reader's registered receive memory, carved per read
ALIGN_BYTES = 64
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


class ReceiveSlabs:
    """Registered memory a reader's engine copies into: large slabs registered once (registering
    per read cost two thirds of a 2 MiB read over loopback TCP), carved into one array per read.

    A slab whose pieces were all dropped is carved again from its start; a full one is retired
    and unregistered once its last piece is dropped (a `weakref.finalize` per piece counts them).
    Thread-safe.
    """

    def __init__(self, engine: Any, slab_bytes: int = RECEIVE_SLAB_BYTES) -> None:
        self._engine, self.slab_bytes = engine, slab_bytes
        self._lock = threading.RLock()  # a piece's finalizer may run inside `take` (GC)
        self._slab: _Slab | None = None

    def take(self, num_bytes: int) -> tuple[np.ndarray, int]:
        """A fresh piece of registered memory of `num_bytes` and its address."""
        with self._lock:
            slab = self._slab
            if slab is None or not slab.fits(num_bytes):
                if slab is not None:
                    slab.retire()
                slab = self._slab = _Slab(self._engine, max(self.slab_bytes, num_bytes))
            return slab.carve(num_bytes)


class _Slab:
    def __init__(self, engine: Any, num_bytes: int) -> None:
        self._engine = engine
        self.array = np.frombuffer(mmap.mmap(-1, num_bytes), np.uint8)
        self.address = self.array.ctypes.data
        if engine.register_memory(self.address, num_bytes) != 0:
            raise StateUnavailableError(f"mooncake could not register a {num_bytes}-byte receive buffer")
        self._lock = threading.RLock()
        self._used = self._live = 0
        self._retired = False

    def fits(self, num_bytes: int) -> bool:
        with self._lock:
            return (0 if self._live == 0 else self._used) + num_bytes <= self.array.nbytes

    def carve(self, num_bytes: int) -> tuple[np.ndarray, int]:
        with self._lock:
            start = 0 if self._live == 0 else -(-self._used // ALIGN_BYTES) * ALIGN_BYTES
            piece = self.array[start : start + num_bytes]
            self._used, self._live = start + num_bytes, self._live + 1
        weakref.finalize(piece, self._dropped)
        return piece, self.address + start

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            if self._live == 0:
                self._engine.unregister_memory(self.address)

    def _dropped(self) -> None:
        with self._lock:
            self._live -= 1
            if self._retired and self._live == 0:
                self._engine.unregister_memory(self.address)


class MooncakeClient:
    """A reader's engine: reads land in registered slabs (`ReceiveSlabs`; RDMA needs both sides
    registered) and are handed out as read-only memoryviews, each its own piece."""

    engine = ENGINE

    def __init__(self, host: str) -> None:
        self._engine = _Engine(host)
        self.address = self._engine.address
        self._slabs = ReceiveSlabs(self._engine.engine)

    def read(self, endpoint: str, address: int, num_bytes: int) -> memoryview:
        return self.read_many(endpoint, [(address, num_bytes)])[0]

    def read_many(self, endpoint: str, places: list[tuple[int, int]]) -> list[memoryview]:
        pieces = [
            self._slabs.take(num_bytes) if num_bytes else (np.empty(0, np.uint8), 0)
            for _, num_bytes in places
        ]
        todo = [(local, address, n) for (address, n), (_, local) in zip(places, pieces, strict=True) if n]
        if todo:
            locals_, addresses, lengths = (list(column) for column in zip(*todo, strict=True))
            status = self._engine.engine.batch_transfer_sync_read(endpoint, locals_, addresses, lengths)
            if status != 0:
                raise StateUnavailableError(
                    f"mooncake read of {sum(lengths)} bytes in {len(todo)} pieces from the store at {endpoint} "
                    f"failed (status {status}): a region was released, or the store is gone or unreachable"
                )
        return [piece.data.toreadonly() for piece, _ in pieces]

    def close(self) -> None:
        """Nothing to free: the engine stops with the process, the slabs with their pieces."""
