"""Where a tensor-parallel worker's other ranks go in a Ray cluster (torch-free: the controller
builds it on a head node without the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankPlacement:
    """The bundles a tensor-parallel worker's ranks 1..N-1 take, and what each reserves.

    The controller reserves one bundle per rank of a replica, consecutive in the pool's placement
    group (deploy/placement.py); the worker's actor (rank 0) sits in `worker_bundle_index`, rank r
    in `worker_bundle_index + r`. Each rank's Ray actor asks for the bundle's whole reservation
    (`num_cpus`, `num_gpus`, `resources`), so with `num_gpus: 1` Ray gives every rank its own GPU.
    """

    group: Any  # ray.util.placement_group.PlacementGroup
    worker_bundle_index: int
    num_cpus: float
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()

    def bundle_index(self, rank: int) -> int:
        """The bundle of rank `rank` (1..N-1) in `group`."""
        return self.worker_bundle_index + rank
