"""The `store` section: one state store per node that hosts a worker."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from splitserve.config.byte_size import ByteSize
from splitserve.config.section import Section


class DiskConfig(Section):
    """The store's disk tier; `path: null` turns it off."""

    # {user} and {deployment} are filled in as a deployment starts (deploy/launcher.py): two never share one
    path: str | None = "/tmp/splitserve-store-{user}/{deployment}"
    bytes: ByteSize = 20 * 2**30


class StoreConfig(Section):
    """The state store: one actor per node that hosts a worker (host RAM first, then disk)."""

    memory_bytes: ByteSize = 2 * 2**30
    disk: DiskConfig = DiskConfig()
    # a state key's lease runs from its writer's first Allocate, at the prefill's start: a 32k-token
    # prompt's prefill on a CPU takes minutes, so the lease matches the gateway's whole-request limit
    lease_s: float = Field(default=600, gt=0)
    num_cpus: float = Field(default=0.25, ge=0)
    # Serves the store's shared-memory arena to readers on other nodes: "mooncake" (the
    # `mooncake` extra, needs libibverbs) or "none" (they get the bytes over gRPC).
    transfer_engine: Literal["none", "mooncake"] = "none"
