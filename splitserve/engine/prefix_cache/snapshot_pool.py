"""KDA state snapshots: every KDA layer's conv and recurrent state at one token boundary."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from splitserve.engine.model.kimi_linear import LayerCaches


class SnapshotPool:
    """Owns `capacity` snapshot rows beside the request slots, named by prefix key, LRU.

    A snapshot is a copy, never shared: `save` copies a request's slot in, `load` copies one out
    into a request's private slot before the request extends it. Putting a new snapshot into a
    full pool evicts the least recently used one, and `on_evict(key)` hears of it.
    """

    def __init__(self, caches: LayerCaches, capacity: int) -> None:
        self.capacity = capacity
        self._caches = caches
        self._layer_ids = list(caches.kda_conv)
        conv = [caches.kda_conv[lid] for lid in self._layer_ids]
        rec = [caches.kda_recurrent[lid] for lid in self._layer_ids]
        self._conv = [torch.zeros(capacity, *t.shape[1:], dtype=t.dtype, device=t.device) for t in conv]
        self._rec = [torch.zeros(capacity, *t.shape[1:], dtype=t.dtype, device=t.device) for t in rec]
        self.snapshot_bytes = sum(t[0].numel() * t.element_size() for t in (*conv, *rec))
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # key -> row, oldest first
        self._free = list(range(capacity - 1, -1, -1))
        self.on_evict: Callable[[bytes], None] | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def used_bytes(self) -> int:
        return len(self._rows) * self.snapshot_bytes

    def save(self, key: bytes, slot: int) -> bool:
        """Copy the state in `slot` under `key` (a key already kept is only touched); False when
        the pool holds no snapshot at all."""
        if key in self._rows:
            self._rows.move_to_end(key)
            return True
        if self.capacity == 0:
            return False
        if not self._free:
            self.evict(next(iter(self._rows)))
        row = self._free.pop()
        if self._caches.replay is not None:
            self._caches.replay.flush(slot)  # ReplaySSM: the pool holds a checkpoint until flushed
        for i, lid in enumerate(self._layer_ids):
            self._conv[i][row].copy_(self._caches.kda_conv[lid][slot])
            self._rec[i][row].copy_(self._caches.kda_recurrent[lid][slot])
        self._rows[key] = row
        return True

    def load(self, key: bytes, slot: int) -> None:
        """Copy the snapshot `key` into the request slot `slot` (which the request then extends)."""
        row = self._rows[key]
        self._rows.move_to_end(key)
        for i, lid in enumerate(self._layer_ids):
            self._caches.kda_conv[lid][slot].copy_(self._conv[i][row])
            self._caches.kda_recurrent[lid][slot].copy_(self._rec[i][row])

    def evict(self, key: bytes) -> None:
        self._free.append(self._rows.pop(key))
        if self.on_evict is not None:
            self.on_evict(key)
