"""`ClusterConfig`: a whole deployment, its sections cross-checked, and each pool's engine knobs."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import model_validator

from splitserve.config.gateway import GatewayConfig
from splitserve.config.health import HealthConfig
from splitserve.config.model import ModelConfig
from splitserve.config.pools import DecodePoolConfig, PoolConfig, PrefillPoolConfig
from splitserve.config.section import Section
from splitserve.config.serving import CacheConfig, RouterConfig
from splitserve.config.store import StoreConfig
from splitserve.engine_config import EngineConfig


class ClusterConfig(Section):
    """A whole deployment. Frozen; the cross-checks below run at construction.

    In `colocated` mode every `prefill` replica also decodes (one worker runs both phases), so
    the `decode` section must be absent or say `replicas: 0`. In `disaggregated` mode the prefill
    pool may have no replica when `prefill.fallback` is `decode_local`: the decode workers then
    compute the prompts themselves (an apply may remove and add the pool so).
    """

    model: ModelConfig = ModelConfig()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    gateway: GatewayConfig = GatewayConfig()
    prefill: PrefillPoolConfig = PrefillPoolConfig()
    decode: DecodePoolConfig = DecodePoolConfig()
    store: StoreConfig = StoreConfig()
    cache: CacheConfig = CacheConfig()
    router: RouterConfig = RouterConfig()
    health: HealthConfig = HealthConfig()

    @model_validator(mode="before")
    @classmethod
    def _colocated_has_no_decode_pool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode") == "colocated" and data.get("decode") is None:
            data = {**data, "decode": {"replicas": 0}}
        return data

    @model_validator(mode="after")
    def _cross_check(self) -> ClusterConfig:
        if self.mode == "colocated" and self.decode.replicas != 0:
            raise ValueError(
                f"decode.replicas: colocated mode runs both phases in each prefill replica, so "
                f"there is no decode pool; remove the decode section or set decode.replicas: 0 "
                f"(got {self.decode.replicas})"
            )
        for name in self.pool_names:
            pool: PoolConfig = getattr(self, name)
            if (
                pool.autoscale is not None
                and pool.autoscale.min_replicas < 1
                and not self._prefill_may_be_empty(name)
            ):
                raise ValueError(
                    f"{name}.autoscale.min_replicas: must be at least 1 (got 0); only a disaggregated "
                    "prefill pool with prefill.fallback: decode_local may scale to no replica"
                )
            if pool.replicas < 1 and not self._prefill_may_be_empty(name):
                hint = (
                    "; 0 removes the prefill pool only with prefill.fallback: decode_local (the decode "
                    "workers then compute prompts)"
                    if name == "prefill" and self.mode == "disaggregated"
                    else ""
                )
                raise ValueError(f"{name}.replicas: must be at least 1 (got {pool.replicas}){hint}")
            if self.cache.prefix_unit % pool.block_size:
                raise ValueError(
                    f"cache.prefix_unit: must be a multiple of {name}.block_size "
                    f"({pool.block_size}; got {self.cache.prefix_unit})"
                )
        if self.cache.retention_interval % self.cache.prefix_unit:
            raise ValueError(
                f"cache.retention_interval: must be a multiple of cache.prefix_unit "
                f"({self.cache.prefix_unit}; got {self.cache.retention_interval})"
            )
        return self

    def _prefill_may_be_empty(self, pool: str) -> bool:
        return pool == "prefill" and self.mode == "disaggregated" and self.prefill.fallback == "decode_local"

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools that run: ("prefill", "decode"), or ("prefill",) in colocated mode."""
        return ("prefill",) if self.mode == "colocated" else ("prefill", "decode")

    def pool_role(self, pool: str) -> str:
        """What the pool's workers do: "prefill", "decode" or (colocated mode) "colocated"."""
        self._check_pool(pool)
        return "colocated" if self.mode == "colocated" else pool

    def pool(self, pool: str) -> PoolConfig:
        self._check_pool(pool)
        return getattr(self, pool)  # type: ignore[no-any-return]

    def engine_config(self, pool: str, *, model_path: str | None = None) -> EngineConfig:
        """The engine knobs of one pool's workers. `model_path` skips resolving the model again."""
        section = self.pool(pool)
        on_gpu = section.num_gpus > 0
        return EngineConfig(
            model=model_path if model_path is not None else self.model.resolved_path(),
            dtype=self.model.dtype,
            device="cuda" if on_gpu else "cpu",
            max_num_seqs=section.max_num_seqs,
            max_num_batched_tokens=section.max_num_batched_tokens,
            kv_cache_memory_bytes=section.kv_cache_memory_bytes,
            block_size=section.block_size,
            preemption_mode=section.preemption_mode,
            swap_space_bytes=section.swap_space_bytes,
            max_model_len=self.model.max_model_len,
            num_threads=None if on_gpu else max(1, int(section.num_cpus)),
            enable_prefix_caching=self.cache.enable_prefix_caching,
            prefix_unit=self.cache.prefix_unit,
            retention_interval=self.cache.retention_interval,
            selective_retention=self.cache.selective_retention,
            snapshot_memory_bytes=self.cache.snapshot_memory_bytes,
            prefix_salt=self.model.served_name,  # the gateway's salt: engines name what they retain alike
            replay_window=getattr(section, "replay_window", 0),  # a decode pool's key only
            enforce_eager=self.pool_role(pool) == "prefill",  # never runs a decode-only step: no graphs
            tensor_parallel_size=section.tensor_parallel,
            expert_parallel=section.expert_parallel,
        )

    def to_yaml(self) -> str:
        """The config as YAML that `load_config` reads back to an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def _check_pool(self, pool: str) -> None:
        if pool not in self.pool_names:
            raise ValueError(f"no pool {pool!r} in {self.mode} mode; pools: {', '.join(self.pool_names)}")
