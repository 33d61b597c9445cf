"""The per-node state store: leased, checksummed state chunks in host RAM spilling to disk.

Torch-free. The core (`StateStore`) is plain Python; `servicer`/`server` put it on gRPC
(proto/splitserve/v1/store.proto) and `actor` runs one per Ray node. What it stores and says
(chunks, errors, records) and its client are the core's `splitserve.state`.
"""

from state_store.config import StoreConfig
from state_store.store import StateStore

__all__ = ["StateStore", "StoreConfig"]
