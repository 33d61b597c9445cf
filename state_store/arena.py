"""The store's shared-memory arena: one file per region in a claimed directory under /dev/shm.

Writers and readers on the store's node `mmap` a region's file by name, so a piece of state is
copied once (into the region) and read in place. A region is its own file, so the kernel does
the allocating. A freed region is kept, up to `pool_bytes`, for the next allocation of about its
size: fresh tmpfs pages cost a zeroing pass and a fault per 4 KiB, more than the copy itself,
and clients keep their mappings of a region's name. So a region's readers must be done with
their views when its key is released or expires (the decode releases a key after its scatter);
beyond the pool a freed region is unlinked, and a mapping others hold stays valid.

The directory is claimed like a disk tier's (`tier_directory`): the store holds a flock on its
`.owner` file while it lives, and a store starting on the same root deletes every sibling
directory whose lock it can take, so the regions of a store that was SIGKILLed are reclaimed by
the next store on the node. A writer that dies holding regions leaves them under its key, which
its lease frees.

With a transfer engine (`store.transfer_engine`, splitserve/state/transport.py) the arena also
serves readers on other nodes: `serve_remote` starts the engine on the store's host, every mapped
region is registered with it while mapped, and `addresses` tells a reader where a region lies.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.state.errors import StoreFullError
from splitserve.state.mapping import map_file
from splitserve.state.transport import TransportEndpoint, TransportServer, check_engine, open_server
from state_store.arena_pool import RegionPool
from state_store.tier_directory import ClaimedDirectory, reclaim_abandoned

DEFAULT_ROOT = "/dev/shm/splitserve-arenas"
DEFAULT_POOL_BYTES = 1 << 30  # freed regions kept mapped for reuse, beyond what the store holds
PROBE_NAME = ".probe"


@dataclass
class Region:
    """One region: its file name in the arena, its size, and the store's own mapping of it."""

    name: str
    num_bytes: int
    view: memoryview = field(repr=False)


class Arena:
    """Owns a claimed directory of region files under `root` (`close` deletes it).

    Thread-safe. Capacity is not counted here: the store counts regions against its memory tier.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] = DEFAULT_ROOT,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        transfer_engine: str = "none",
    ) -> None:
        check_engine(transfer_engine)
        self.reclaimed_bytes = reclaim_abandoned(root)
        self._claim = ClaimedDirectory(root)
        self.directory = self._claim.path
        self.probe_token = secrets.token_bytes(16)
        (self.directory / PROBE_NAME).write_bytes(self.probe_token)
        self._names = itertools.count()
        self._lock = threading.Lock()
        self._pool = RegionPool(pool_bytes)  # freed regions kept for reuse (their pages are resident)
        self.transfer_engine = transfer_engine
        self._transport: TransportServer | None = None
        self._mapped: dict[str, memoryview] = {}  # every region mapped now (held or pooled)
        self._addresses: dict[str, int] = {}  # those registered with the transport: their address

    @classmethod
    def open_default(
        cls, root: str | None, pool_bytes: int = DEFAULT_POOL_BYTES, transfer_engine: str = "none"
    ) -> Arena | None:
        """An arena under `root`, or None when `root` is None or its filesystem is missing."""
        if root is None or not Path(root).parent.is_dir():
            return None
        return cls(root, pool_bytes, transfer_engine)

    def serve_remote(self, host: str) -> TransportEndpoint | None:
        """Starts the arena's transfer engine on `host` (the address its readers reach) and
        registers every region with it; its endpoint, or None when the engine is "none".
        Idempotent. Raises ImportError naming the extra when the engine is not installed."""
        with self._lock:
            if self._transport is None and self.transfer_engine != "none":
                transport = self._transport = open_server(self.transfer_engine, host)
                assert transport is not None  # only "none" has no server
                for name, view in self._mapped.items():
                    self._addresses[name] = transport.register(view)
            return None if self._transport is None else self._transport.endpoint

    @property
    def endpoint(self) -> TransportEndpoint | None:
        """The transfer engine readers elsewhere pull regions with (None: not serving remote)."""
        return None if self._transport is None else self._transport.endpoint

    def addresses(self, names: list[str]) -> dict[str, int]:
        """{name: address in this process} of those of `names` still mapped and registered."""
        with self._lock:
            return {name: self._addresses[name] for name in names if name in self._addresses}

    def allocate(self, num_bytes: int) -> Region:
        """A region of `num_bytes` (up to twice that if a freed one is reused; its `num_bytes`
        says), mapped read-write by the store. A new one is zero-filled, a reused one holds old
        bytes. Raises `StoreFullError` if the arena's filesystem has no room for it."""
        if num_bytes < 0:
            raise ValueError(f"a region needs >= 0 bytes (got {num_bytes})")
        with self._lock:
            region = self._pool.take(num_bytes)
            if region is not None:  # a freed region's pages are already there: no zeroing, no faults
                return region
            name = f"{next(self._names):012d}.region"
        path = self.directory / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if num_bytes:  # reserve the pages now: a full tmpfs is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, num_bytes)
            view = map_file(fd, num_bytes, writable=True)  # keeps no fd open: one region per prefix
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise StoreFullError(f"no room for a {num_bytes}-byte region in {self.directory}: {e}") from None
        os.close(fd)
        region = Region(name, num_bytes, view)
        if num_bytes:
            with self._lock:
                self._mapped[name] = region.view
                if self._transport is not None:
                    self._addresses[name] = self._transport.register(region.view)
        return region

    def free(self, region: Region) -> None:
        """Keeps the region for reuse while the pool has room, else unlinks its file (mappings
        others still hold stay valid until dropped). Either way its key's readers must be done:
        a reused region is written again."""
        with self._lock:
            if self._pool.add(region):
                return
            self._mapped.pop(region.name, None)
            address = self._addresses.pop(region.name, None)
            if address is not None and self._transport is not None:
                self._transport.unregister(address)  # before the mapping can go away
        (self.directory / region.name).unlink(missing_ok=True)

    @property
    def pool_bytes(self) -> int:
        """The most bytes of freed regions kept for reuse."""
        return self._pool.capacity_bytes

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return self._pool.num_bytes

    def close(self) -> None:
        with self._lock:
            if self._transport is not None:
                self._transport.close()
            self._addresses.clear()
        self._claim.release()
