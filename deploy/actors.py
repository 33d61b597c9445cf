"""The actor classes the controller starts, found by kind, and what their constructors take.

The real classes live in their own packages and are imported only when first needed; a test
may pass its own class for any kind (`Controller(actor_classes=...)`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import ray

from splitserve.config import ClusterConfig

DEFAULT_CLASSES = {
    "store": ("state_store.actor", "StateStoreActor"),
    "prefill": ("prefill_worker.actor", "PrefillWorkerActor"),
    "decode": ("decode_worker.actor", "DecodeWorkerActor"),
    "colocated": ("colocated_worker.actor", "ColocatedWorkerActor"),
    "gateway": ("frontend.actor", "GatewayActor"),
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
        "api_keys": list(config.gateway.api_keys),
        "drain_timeout_s": config.health.drain_timeout_s,
    }
    max_model_len = config.model.max_model_len or _checkpoint_context(model_path)
    if max_model_len is not None:  # else the gateway's own default applies
        kwargs["max_model_len"] = max_model_len
    return kwargs


def says_healthy(answer: Any) -> bool:
    """`health()` may return a bool or a report dict (healthy unless it says "healthy"/"serving": false)."""
    if isinstance(answer, dict):
        return bool(answer.get("healthy", answer.get("serving", True)))
    return bool(answer)


def _checkpoint_context(model_path: str | None) -> int | None:
    """The checkpoint's own context length (`max_position_embeddings`), if its config says."""
    if model_path is None:
        return None
    try:
        with open(Path(model_path) / "config.json", encoding="utf-8") as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value >= 2 else None
