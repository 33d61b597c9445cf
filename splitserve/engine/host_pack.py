"""Host integers bound for the device, sent in one copy."""

from __future__ import annotations

import array

import torch

from splitserve.engine.host_staging import to_device


class HostPack:
    """Collects a step's host int64 tensors and moves them to the device in one copy.

    Each host-to-device copy is a driver call, and from pageable memory it also waits for the
    device's stream; a step's indices (token ids, KV rows, block tables, per-row counters) cost one
    such copy instead of one each, from pinned memory (`host_staging.to_device`: queued on the
    stream, the host goes on). `add` returns an id; after `to`, `get(id)` is that piece's view
    of the device tensor.
    """

    def __init__(self) -> None:
        self._pieces: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []

    def add(self, piece: torch.Tensor) -> int:
        assert piece.dtype == torch.long, f"HostPack holds int64 only, got {piece.dtype}"
        self._pieces.append(piece.reshape(-1))
        return len(self._pieces) - 1

    def to(self, device: torch.device) -> None:
        flat = to_device(torch.cat(self._pieces), device)
        self._views = list(flat.split([p.numel() for p in self._pieces]))

    def get(self, piece_id: int) -> torch.Tensor:
        return self._views[piece_id]


def long_tensor(values: list[int]) -> torch.Tensor:
    """A host int64 tensor of `values`."""
    return torch.tensor(values, dtype=torch.long)


def block_tables(tables: list[list[int]], width: int, fill: int = 0) -> torch.Tensor:
    """Host [len(tables), width] int64: each table's first `width` block ids, then `fill` (one
    buffer filled by list slices: no tensor per row, no Python loop per block)."""
    if not tables or width == 0:
        return torch.full((len(tables), width), fill, dtype=torch.long)
    buf = array.array("q", [fill]) * (len(tables) * width)
    for i, table in enumerate(tables):
        row = table[:width]
        buf[i * width : i * width + len(row)] = array.array("q", row)
    return torch.frombuffer(buf, dtype=torch.long).view(len(tables), width)
