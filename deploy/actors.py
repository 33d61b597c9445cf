"""The actor classes the controller starts, found by kind, and what their constructors take.

The real classes live in their own packages and are imported only when first needed; a test
may pass its own class for any kind (`Controller(actor_classes=...)`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import ray

from splitserve.config import ClusterConfig, gateway_api_keys
from splitserve.engine.cache_spec import plan_cache
from splitserve.engine.model_config import KimiLinearModelConfig

logger = logging.getLogger(__name__)

DEFAULT_CLASSES = {
    "store": ("state_store.actor", "StateStoreActor"),
    "prefill": ("prefill_worker.actor", "PrefillWorkerActor"),
    "decode": ("decode_worker.actor", "DecodeWorkerActor"),
    "colocated": ("colocated_worker.actor", "ColocatedWorkerActor"),
    "gateway": ("frontend.actor", "GatewayActor"),
    "ledger": ("frontend.ledger_actor", "LedgerActor"),
    "gateway_settings": ("frontend.settings", "GatewaySettings"),
}


class StartError(RuntimeError):
    """An actor could not be created or its `start()` failed: the message names which."""


def load_actor_class(kind: str, override: Any = None) -> Any:
    """The Ray actor class for `kind` (plain classes are wrapped in `ray.remote`)."""
    cls = override
    if cls is None:
        module, name = DEFAULT_CLASSES[kind]
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise StartError(f"the {kind} class {module}.{name} is not available: {exc}") from None
    if kind != "gateway_settings" and not isinstance(cls, ray.actor.ActorClass):
        cls = ray.remote(cls)
    return cls


def gateway_settings_kwargs(config: ClusterConfig, model_path: str | None) -> dict[str, Any]:
    """Keyword arguments for the gateway's settings class, from the cluster config."""
    kwargs: dict[str, Any] = {
        "model_name": config.model.served_name,
        "model_path": model_path,
        "host": config.gateway.host,
        "port": config.gateway.port,
        "api_keys": list(gateway_api_keys(config.gateway)),  # from the file, a variable or a file
        "max_request_bytes": config.gateway.max_request_bytes,
        "max_prompt_chars": config.gateway.max_prompt_chars,
        "drain_timeout_s": config.health.drain_timeout_s,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "prefix_unit": config.cache.prefix_unit,
        "router_policy": config.router.policy,
        "local_prefill_max_tokens": config.router.local_prefill_max_tokens,
        "max_queued_requests": config.gateway.max_queued_requests,
        "header_read_timeout_s": config.gateway.header_read_timeout_s,
        "body_read_timeout_s": config.gateway.body_read_timeout_s,
        "request_read_timeout_s": config.gateway.request_read_timeout_s,
        "keep_alive_timeout_s": config.gateway.keep_alive_timeout_s,
        "max_connections_per_client": config.gateway.max_connections_per_client,
        "prefill_fallback": config.prefill.fallback,
        "decode_failover": config.decode.failover,
        "decode_failover_wait_s": config.decode.failover_wait_s,
    }
    max_model_len = served_max_model_len(config, model_path)
    if max_model_len is not None:  # else the gateway's own default applies
        kwargs["max_model_len"] = max_model_len
    return kwargs


def says_healthy(answer: Any) -> bool:
    """`health()` may return a bool or a report dict (healthy unless it says "healthy"/"serving": false)."""
    if isinstance(answer, dict):
        return bool(answer.get("healthy", answer.get("serving", True)))
    return bool(answer)


def served_max_model_len(config: ClusterConfig, model_path: str | None) -> int | None:
    """The longest request every pool takes, so the gateway refuses longer ones with a 400.

    Each pool's engine serves `model.max_model_len` if given, else the longest request its KV
    budget holds (at most the checkpoint's context); this is the same torch-free arithmetic
    (`plan_cache`) over the checkpoint's config.json, and the minimum over the pools. None when
    that config cannot be read (the gateway's own default applies).
    """
    if model_path is None:
        return config.model.max_model_len
    try:
        model = KimiLinearModelConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return config.model.max_model_len
    lengths = {}
    for pool in config.pool_names:
        engine = config.engine_config(pool, model_path=model_path)
        assert engine.kv_cache_memory_bytes is not None  # a pool's budget is always explicit
        lengths[pool] = plan_cache(model, engine, engine.kv_cache_memory_bytes)[1]
    chosen = min(lengths.values())
    if config.model.max_model_len is None:
        logger.info("model.max_model_len not given: the gateway takes up to %d tokens %s", chosen, lengths)
    return chosen
