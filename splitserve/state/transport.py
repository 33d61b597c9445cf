"""Reading a store's arena from another node: the small interface a transfer engine sits behind.

A store on one node holds a request's state in its shared-memory arena (state_store/arena.py).
A reader on the same node maps the region files (`LocalArena`); a reader elsewhere either gets
the bytes over gRPC, or, when the store was started with a transfer engine
(`store.transfer_engine`), pulls the committed bytes straight out of the store's memory with it:
the store registers each region with its engine (`TransportServer`) and tells readers its
engine's endpoint and each region's address (the `Arena` RPC); a reader's `TransportClient`
copies (address + offset, length) into a buffer of its own, and the Get's checksum is verified
before a byte is used, so a region released and reused meanwhile fails closed
(`CorruptStateError`), as does one already unmapped (`StateUnavailableError`).

Implementations: `transport_mooncake` (Mooncake Transfer Engine, an optional extra). `none`
keeps the gRPC byte stream. Nothing here imports an engine: `open_server`/`open_client` import
the one named, lazily.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from splitserve.state.errors import StateUnavailableError

TRANSFER_ENGINES = ("none", "mooncake")


@dataclass(frozen=True)
class TransportEndpoint:
    """Where a store's transfer engine listens: its engine's name and "host:port"."""

    engine: str
    address: str


class TransportServer(Protocol):
    """A store's side: makes regions of its memory readable by remote `TransportClient`s."""

    endpoint: TransportEndpoint

    def register(self, view: memoryview) -> int:
        """Makes `view` (a writable mapping the caller keeps alive) readable; its address."""
        ...

    def unregister(self, address: int) -> None:
        """Stops serving the memory registered at `address` (before it is unmapped)."""
        ...

    def close(self) -> None: ...


class TransportClient(Protocol):
    """A reader's side: copies a remote store's registered memory into local buffers."""

    engine: str

    def read(self, endpoint: str, address: int, num_bytes: int) -> memoryview:
        """`num_bytes` from `address` of the store at `endpoint`, in a fresh buffer of this
        process (the caller verifies them). Raises `StateUnavailableError` if the store does not
        serve that memory (released, store gone, unreachable)."""
        ...

    def read_many(self, endpoint: str, places: list[tuple[int, int]]) -> list[memoryview]:
        """`read` of each (address, num_bytes), all in one batch of the engine."""
        ...

    def close(self) -> None: ...


def open_server(engine: str, host: str) -> TransportServer | None:
    """The store's side of `engine` listening on `host` (an address its readers reach), or None
    for "none". Raises `ImportError` naming the extra when the engine is not installed."""
    check_engine(engine)
    if engine == "none":
        return None
    from splitserve.state.transport_mooncake import MooncakeServer

    return MooncakeServer(host)


def open_client(engine: str, host: str) -> TransportClient:
    """A reader's side of `engine` (not "none"), bound to `host` (this node's address)."""
    check_engine(engine)
    if engine == "none":
        raise ValueError("transfer engine 'none' moves no bytes itself; read through gRPC instead")
    from splitserve.state.transport_mooncake import MooncakeClient

    return MooncakeClient(host)


def check_engine(engine: str) -> None:
    if engine not in TRANSFER_ENGINES:
        raise ValueError(f"unknown transfer engine {engine!r}; choose one of {', '.join(TRANSFER_ENGINES)}")


# region names -> {name: address in the store's memory} of those the store still holds
RegionLocator = Callable[[list[str]], dict[str, int]]


class RemoteRegions:
    """A remote store's arena read through a transfer engine: `read(region, offset, num_bytes)`,
    as `LocalArena.read` on the store's node, but into a buffer of this process.

    Owns nothing but a cache of region addresses (a region keeps its name and mapping, hence its
    address, until the store unmaps it; names are never reused). Thread-safe.
    """

    def __init__(self, client: TransportClient, endpoint: TransportEndpoint, locate: RegionLocator) -> None:
        if client.engine != endpoint.engine:
            raise ValueError(
                f"the store serves its arena with {endpoint.engine!r}, this reader has {client.engine!r}"
            )
        self.client, self.endpoint = client, endpoint
        self._locate = locate
        self._lock = threading.Lock()
        self._addresses: dict[str, int] = {}

    def read(self, region: str, offset: int, num_bytes: int) -> memoryview:
        """The bytes of `region` at [offset, offset + num_bytes), copied here (unverified)."""
        return self.read_many([(region, offset, num_bytes)])[0]

    def read_many(self, places: list[tuple[str, int, int]]) -> list[memoryview]:
        """`read` of each (region, offset, num_bytes), in one batch of the engine."""
        with self._lock:
            unknown = sorted({region for region, _, _ in places if region not in self._addresses})
        if unknown:
            found = self._locate(unknown)
            with self._lock:
                self._addresses.update(found)
            if len(found) < len(unknown):
                gone = sorted(set(unknown) - set(found))
                raise StateUnavailableError(
                    f"regions {gone} of the store at {self.endpoint.address} are gone: their key was released"
                )
        with self._lock:
            wanted = [(self._addresses[region] + offset, n) for region, offset, n in places]
        return self.client.read_many(self.endpoint.address, wanted)
