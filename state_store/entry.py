"""One stored key's bookkeeping inside the store: its chunks' metadata, seal, pins, waiters."""

from __future__ import annotations

import threading

from state_store.chunk import ChunkId, ChunkMeta
from state_store.errors import StateStoreError

Gone = tuple[type[StateStoreError], str]


class Entry:
    """One key's chunks (metadata only: the bytes live in the tiers), seal flag, pins, waiters.

    Not thread-safe: the store holds its lock (the one `cond` is built on) around every use.
    `gone` is set, and the waiters woken, when the store drops the key.
    """

    def __init__(self, key: str, owner: str, lock: threading.Lock) -> None:
        self.key = key
        self.owner = owner
        self.cond = threading.Condition(lock)
        self.metas: dict[ChunkId, ChunkMeta] = {}
        self.order: list[ChunkId] = []
        self.sealed = False
        self.num_bytes = 0
        self.num_pins = 0
        self.gone: Gone | None = None

    def add(self, meta: ChunkMeta) -> None:
        self.metas[meta.id] = meta
        self.order.append(meta.id)
        self.num_bytes += meta.num_bytes

    def discard(self, meta: ChunkMeta) -> None:
        del self.metas[meta.id]
        self.order.remove(meta.id)
        self.num_bytes -= meta.num_bytes

    def raise_if_gone(self) -> None:
        if self.gone is not None:
            cls, why = self.gone
            raise cls(why)
