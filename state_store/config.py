"""How one store is sized and how long unclaimed state lives in it."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.state.chunk import MAX_CHUNK_BYTES


@dataclass(frozen=True)
class StoreConfig:
    """How big each tier is and how long unclaimed state lives. `disk_path=None`: no disk tier."""

    memory_bytes: int = 2 << 30
    disk_path: str | None = None
    disk_bytes: int = 0
    default_lease_s: float = 60.0
    max_chunk_bytes: int = MAX_CHUNK_BYTES
    num_tombstones: int = 65536  # gone keys remembered, so a late read says why it failed
    # Shared-memory arena for writers and readers on this node (None: bytes over gRPC only).
    arena_root: str | None = "/dev/shm/splitserve-arenas"
    arena_pool_bytes: int = 1 << 30  # freed regions kept for reuse (resident RAM beyond memory_bytes)
    # Retained prefixes (registered in the prefix index) may hold this much; least recently hit
    # go first. None: half of memory_bytes, so handoff state always has room beside them.
    prefix_budget_bytes: int | None = None
    # Serves the arena to readers on other nodes ("mooncake", an optional extra; "none": they
    # get the bytes over gRPC). Started by the server on its host (splitserve/state/transport.py).
    transfer_engine: str = "none"

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ValueError(
                f"store tier sizes must be >= 0 (memory {self.memory_bytes}, disk {self.disk_bytes})"
            )
        if self.disk_path is not None and self.disk_bytes == 0:
            raise ValueError(
                f"store disk tier at {self.disk_path!r} has 0 bytes; set disk_bytes or drop disk_path"
            )
        if self.prefix_budget_bytes is None:
            object.__setattr__(self, "prefix_budget_bytes", self.memory_bytes // 2)
        elif self.prefix_budget_bytes < 0:
            raise ValueError(f"prefix_budget_bytes must be >= 0 (got {self.prefix_budget_bytes})")
        if not self.default_lease_s > 0:
            raise ValueError(f"default_lease_s must be > 0 seconds (got {self.default_lease_s})")
