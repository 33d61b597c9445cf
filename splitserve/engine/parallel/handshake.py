"""The messages a rank and its driver exchange while the rank starts (a module of their own: the
rank's process runs `rank_process` as `__main__`, where a pickled class could not be found)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.parallel.rendezvous import StoreAddress
from splitserve.engine_config import EngineConfig


@dataclass(frozen=True)
class RankSetup:
    """What a rank needs to join: its engine config (its own device), its rank and the store."""

    config: EngineConfig
    rank: int
    world_size: int
    store: StoreAddress


@dataclass(frozen=True)
class RankJoining:
    """Sent just before joining the group: the driver joins only once every rank is this far."""

    rank: int


@dataclass(frozen=True)
class RankReady:
    """The rank's shard is loaded and its engine built."""

    rank: int


@dataclass(frozen=True)
class RankFailed:
    rank: int
    error: str
