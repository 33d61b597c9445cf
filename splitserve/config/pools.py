"""The worker pools' sections: what every pool has (`PoolConfig`), and what only prefill or
only decode workers do."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from splitserve.config.autoscale import AutoscaleConfig, SloConfig
from splitserve.config.byte_size import ByteSize
from splitserve.config.section import Section

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
# Resources Ray names itself that a bundle may not ask for here: CPUs and GPUs through num_cpus
# and num_gpus, Ray's memory accounting not at all. A node's own `node:<ip>` resource may be named
# (it pins the pool to that node).
_RAY_MEMORY_RESOURCES = ("memory", "object_store_memory")


class PoolConfig(Section):
    """One worker pool: how many replicas, what each reserves from Ray, and its engine knobs.

    The replicas of a pool share one Ray placement group per resize step, with `placement` as
    its strategy (PACK: fill nodes in turn; STRICT_SPREAD: one replica per node).

    Placement a user controls: `resources` are Ray custom resources each replica's bundle
    reserves besides its CPUs and GPUs (a node offers them with `ray start --resources`), and
    `node_labels` are the Ray node labels its node must carry (`ray start --labels`), so a pool
    can be put on one node type. `num_gpus` may be a fraction: workers then share a GPU.

    `tensor_parallel` N > 1 runs each replica as N ranks (the worker's actor and N - 1 Ray actors
    joined by torch.distributed: heads, MLP columns and the vocabulary split over them;
    engine/parallel/), with `expert_parallel` spreading the routed experts over them whole.
    `num_cpus` and `num_gpus` are then per rank: a replica reserves one bundle per rank (on GPUs one
    whole GPU each: `num_gpus: 1`), all on one node, so `placement` packs (PACK or STRICT_PACK).

    `autoscale` lets the controller's planner move `replicas` between its bounds by load against
    `slo` (splitserve/config/autoscale.py); `replicas` is then where the pool starts (by default
    `autoscale.min_replicas`).
    """

    replicas: int = Field(default=1, ge=0)
    num_cpus: float = Field(default=1, gt=0)
    num_gpus: float = Field(default=0, ge=0)
    tensor_parallel: int = Field(default=1, ge=1)  # ranks per replica; num_cpus/num_gpus are per rank
    expert_parallel: bool = False  # with tensor_parallel > 1: the routed experts spread over the ranks
    placement: PlacementStrategy = "PACK"
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    kv_cache_memory_bytes: ByteSize = 256 * 2**20
    block_size: int = Field(default=16, ge=1)
    # how a decoding request that runs out of KV blocks is preempted: recompute (its state is freed,
    # prompt + outputs computed again) or swap (its state waits in the node's store, or for a
    # colocated worker in `swap_space_bytes` of host memory, and is copied back: no recompute)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: ByteSize = 4 * 2**30
    # what `config plan` and `up` check the weights, cache and activations against (one GPU, or
    # the host's RAM for a CPU pool); None: the device visible where the plan is made
    device_memory_bytes: ByteSize | None = None
    # Ray custom resources each replica's bundle reserves too, e.g. {prefill_node: 1}
    resources: dict[str, float] = Field(default_factory=dict)
    # Ray node labels the replica's node must carry, e.g. {node-type: h200} ("!x", "in(a,b)", "!in(a,b)" too)
    node_labels: dict[str, str] = Field(default_factory=dict)
    # None: `replicas` stays as set; else the planner's bounds and knobs
    autoscale: AutoscaleConfig | None = None
    slo: SloConfig = SloConfig()

    @model_validator(mode="before")
    @classmethod
    def _autoscaled_starts_at_min(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("autoscale") is not None and "replicas" not in data:
            autoscale = data["autoscale"]
            minimum = (
                autoscale.get("min_replicas", 1) if isinstance(autoscale, dict) else autoscale.min_replicas
            )
            data = {**data, "replicas": minimum}
        return data

    @model_validator(mode="after")
    def _replicas_within_autoscale(self) -> PoolConfig:
        scale = self.autoscale
        if scale is not None and scale.clamp(self.replicas) != self.replicas:
            raise ValueError(
                f"replicas ({self.replicas}) lies outside autoscale's bounds ({scale.min_replicas}.."
                f"{scale.max_replicas}); give replicas between them, or leave it out to start at min_replicas"
            )
        if scale is None and self.slo != SloConfig():
            raise ValueError("slo is read only by the autoscaler: add an autoscale section, or remove slo")
        return self

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{name!r} is not a custom resource: set num_{name.lower()}s instead")
            if name in _RAY_MEMORY_RESOURCES:
                raise ValueError(
                    f"{name!r} is Ray's own resource; resources names custom ones (those a node offers "
                    "with `ray start --resources`)"
                )
            if not name or amount <= 0:
                raise ValueError(f"each resource needs a name and an amount above 0 (got {name!r}: {amount})")
        return value

    @field_validator("node_labels")
    @classmethod
    def _named_labels(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not key or not label for key, label in value.items()):
            raise ValueError(f"each node label needs a key and a value (got {value})")
        return value

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu_at_most(cls, value: float) -> float:
        if value > 1:  # per rank: a worker spans several GPUs with tensor_parallel
            raise ValueError(
                f"num_gpus is per rank: give 1 (and tensor_parallel N for N GPUs per worker), or a "
                f"fraction such as 0.5 to share one GPU between workers (got {value:g})"
            )
        return value

    @model_validator(mode="after")
    def _ranks_on_one_node(self) -> PoolConfig:
        if self.tensor_parallel > 1 and self.placement not in ("PACK", "STRICT_PACK"):
            raise ValueError(
                f"placement {self.placement} with tensor_parallel {self.tensor_parallel}: a replica's ranks "
                "run on one node, so its bundles must be packed; use PACK or STRICT_PACK"
            )
        if self.tensor_parallel > 1 and 0 < self.num_gpus < 1:
            raise ValueError(
                f"num_gpus {self.num_gpus:g} with tensor_parallel {self.tensor_parallel}: each rank takes a "
                "whole GPU of its own (Ray could give two ranks of a replica one shared GPU, which NCCL "
                "refuses); give num_gpus: 1, or tensor_parallel: 1 to share GPUs between workers"
            )
        if self.tensor_parallel > 1 and self.preemption_mode == "swap":
            raise ValueError(
                "preemption_mode swap with tensor_parallel > 1: the ranks' head-ranged states are not "
                "swapped to the store; use preemption_mode recompute"
            )
        if self.expert_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "expert_parallel spreads experts over a replica's ranks: set tensor_parallel > 1"
            )
        return self


class PrefillPoolConfig(PoolConfig):
    """The prefill pool: a `PoolConfig` plus what only prefill workers do.

    `fallback` says what the gateway does while the pool has no worker: `decode_local` (the
    decode worker computes the prompt itself) or `fail` (503 naming the empty pool).
    """

    fallback: Literal["decode_local", "fail"] = "decode_local"


class DecodePoolConfig(PoolConfig):
    """The decode pool: a `PoolConfig` plus what only decode workers do.

    `failover`: when a decode worker is lost mid-stream, the gateway resumes each of its
    requests on another worker (from the lost worker's stored state when it kept one, else by
    re-prefill of prompt + the tokens already sent; the stream goes on with no token repeated or
    missing); false ends those streams with a 503 error event.
    `failover_wait_s`: how long such a stream may wait for a decode worker to resume on (all
    others full or unreachable, or the only one being restarted by the controller), and how long
    a new request waits for one to be reachable at all, trying again with a growing backoff; the
    request's own timeout bounds it too.
    `replay_window`: KDA decode in ReplaySSM form with a ring of this many step records
    (engine/replay_ring.py); each decode worker then keeps every request's state in its node's
    store as it decodes (prompt state + a piece every window, decode_worker/replay_publisher.py),
    and a failover resumes from it, recomputing fewer than this many tokens (at any
    `tensor_parallel`: a tensor-parallel worker stores one KDA piece per rank naming its heads, and
    the resuming worker, of any width, assembles them). 0 (the default) runs
    the plain recurrent path and failover re-prefills: on a CPU the rings cost about 20% of a
    tiny model's decode step (docs/PERFORMANCE.md sections 7 and 8).
    """

    failover: bool = True
    failover_wait_s: float = Field(default=60.0, ge=0)
    # ReplaySSM: KDA decode keeps a checkpoint + a ring of this many step records per layer
    # (0: the plain recurrent path)
    replay_window: int = Field(default=0, ge=0)
