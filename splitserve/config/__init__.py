"""The cluster config: one YAML file, validated at load, frozen afterwards.

`load_config(path)` reads a file into a `ClusterConfig` or raises one `ConfigError` that names the
file, each offending key (as a dotted path) and what is wrong with it. `default_config()` is the
embedded default (the same as `deploy/configs/default.yaml`): the tiny model on one machine's
CPUs. `ClusterConfig.engine_config(pool)` derives one pool's `EngineConfig`.

One module per concept: `byte_size` (sizes like "2GiB"), `section` (the frozen base), one per
section (`model`, `gateway`, `pools`, `autoscale`, `store`, `serving` for cache and router, `health`),
`cluster` (the whole deployment and its cross-checks) and `loading` (files, errors).
Everything is importable from here.

Torch-free: the model path of the default is only resolved (and the tiny model built) when a
caller asks for it through `ModelConfig.resolved_path()`.
"""

from __future__ import annotations

from splitserve.config.autoscale import AutoscaleConfig, SloConfig
from splitserve.config.byte_size import ByteSize, format_bytes, parse_bytes
from splitserve.config.cluster import ClusterConfig
from splitserve.config.gateway import GatewayConfig, gateway_api_keys
from splitserve.config.health import HealthConfig
from splitserve.config.loading import (
    ConfigError,
    default_config,
    load_config,
    parse_config,
    with_gateway_address,
)
from splitserve.config.model import DEFAULT_MODEL_NAME, ModelConfig
from splitserve.config.pools import DecodePoolConfig, PlacementStrategy, PoolConfig, PrefillPoolConfig
from splitserve.config.serving import CacheConfig, RouterConfig
from splitserve.config.store import DiskConfig, StoreConfig

__all__ = [
    "DEFAULT_MODEL_NAME",
    "AutoscaleConfig",
    "ByteSize",
    "CacheConfig",
    "ClusterConfig",
    "ConfigError",
    "DecodePoolConfig",
    "DiskConfig",
    "GatewayConfig",
    "HealthConfig",
    "ModelConfig",
    "PlacementStrategy",
    "PoolConfig",
    "PrefillPoolConfig",
    "RouterConfig",
    "SloConfig",
    "StoreConfig",
    "default_config",
    "format_bytes",
    "gateway_api_keys",
    "load_config",
    "parse_bytes",
    "parse_config",
    "with_gateway_address",
]
