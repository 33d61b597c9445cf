"""What one worker of a pool runs and where: the unit the controller compares when a config changes.

Two workers with equal specs are interchangeable; a pool whose spec changes is rolled (each
replica replaced by one of the new spec). The replica count, and the keys only the gateway or
the memory plan read (`prefill.fallback`, `decode.failover*`, `device_memory_bytes`), are not
part of a spec: changing them replaces no worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from splitserve.config import PoolConfig
from splitserve.engine_config import EngineConfig


@dataclass(frozen=True)
class WorkerSpec:
    """A worker's engine config and its Ray reservation: CPUs, GPUs, custom resources, the node
    labels its node must carry, and the placement strategy of the group it is reserved in.

    A tensor-parallel worker (`num_ranks` = its engine's `tensor_parallel_size` > 1) reserves one
    `bundle` per rank, consecutive in its group, on one node (`deploy/placement.py` checks): the
    worker's actor (rank 0) sits in the first and starts each other rank as a Ray actor in the
    next ones (`splitserve.rank_placement`), so with `num_gpus: 1` each rank has a GPU of its own.
    """

    engine: EngineConfig
    num_cpus: float
    num_gpus: float
    resources: tuple[tuple[str, float], ...] = ()
    node_labels: tuple[tuple[str, str], ...] = ()
    placement: str = "PACK"

    @classmethod
    def of(cls, section: PoolConfig, engine: EngineConfig) -> WorkerSpec:
        return cls(
            engine=engine,
            num_cpus=float(section.num_cpus),
            num_gpus=float(section.num_gpus),
            resources=tuple(sorted((k, float(v)) for k, v in section.resources.items())),
            node_labels=tuple(sorted(section.node_labels.items())),
            placement=section.placement,
        )

    @property
    def bundle(self) -> dict[str, float]:
        """The Ray resources one rank of a replica reserves: its CPUs, GPUs and custom resources."""
        return _bundle(self.num_cpus, self.num_gpus, dict(self.resources))

    @property
    def num_ranks(self) -> int:
        """Bundles per replica: one per tensor-parallel rank."""
        return self.engine.tensor_parallel_size

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.node_labels)

    def same_reservation(self, other: WorkerSpec | None) -> bool:
        """Whether a bundle reserved for `other` fits this spec exactly (so it can take it over)."""
        return other is not None and (self.bundle, self.num_ranks, self.node_labels, self.placement) == (
            other.bundle,
            other.num_ranks,
            other.node_labels,
            other.placement,
        )

    def differences(self, other: WorkerSpec) -> dict[str, tuple[Any, Any]]:
        """Each setting in which `other` differs from this spec: name -> (this value, other's)."""
        mine, theirs = _settings(self), _settings(other)
        return {name: (mine[name], theirs[name]) for name in mine if mine[name] != theirs[name]}


def bundle_of(section: PoolConfig) -> dict[str, float]:
    """The Ray resources one replica of the pool reserves: its CPUs, GPUs and custom resources."""
    return _bundle(float(section.num_cpus), float(section.num_gpus), section.resources)


def _bundle(num_cpus: float, num_gpus: float, resources: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": num_cpus}
    if num_gpus > 0:
        bundle["GPU"] = num_gpus
    bundle.update({name: float(amount) for name, amount in resources.items()})
    return bundle


def _settings(spec: WorkerSpec) -> dict[str, Any]:
    """The spec's settings and its engine's, by name, in one flat dict."""
    flat = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "engine"}
    flat.update(dataclasses.asdict(spec.engine))
    return flat
