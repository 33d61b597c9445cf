"""What a new config would change in a running deployment, decided before anything changes.

`refusals(running, new, gateway_settings)` lists what cannot change live, each with the reason
and what to do instead: the model, the mode, the stores, the gateway (its section, and the
settings it was built with from other sections: the router, prefix caching, the pools'
fallback and failover, the longest request served). Everything else can change live: each
pool's replica count and worker spec (`deploy/worker_spec.py`; a pool whose spec changes is
rolled), and the controller's own `health` settings.

`describe_plan(pools, targets)` says in words what an apply will do to each pool, from what runs
(the pools' members) to what the new config asks (`PoolTarget`s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from deploy.members import Pool
from deploy.worker_spec import WorkerSpec
from splitserve.config import ClusterConfig

SECRET_KEYS = frozenset({"api_keys"})  # their values never go into a message
# The gateway's own copy of drain_timeout_s is never used in a deployment: the controller passes
# health.drain_timeout_s when it stops the gateway, so that key changes live.
_GATEWAY_SETTINGS_CONTROLLER_OWNS = frozenset({"drain_timeout_s"})
_STOP_AND_UP = "stop the deployment and `splitserve up` it with the new config"


@dataclass(frozen=True)
class PoolTarget:
    """What the new config asks of one pool: this many replicas, each running `spec`."""

    name: str
    spec: WorkerSpec
    replicas: int


def refusals(
    running: ClusterConfig,
    new: ClusterConfig,
    gateway_settings: Callable[[ClusterConfig], Mapping[str, Any]],
) -> list[str]:
    """Why `new` cannot be applied to a deployment running `running`; empty when it can."""
    found = []
    if running.mode != new.mode:
        found.append(
            f"mode cannot change live ({running.mode} -> {new.mode}): the pools and the gateway's "
            f"routing follow it; {_STOP_AND_UP}"
        )
    reasons = {
        "model": "every worker and the gateway serve it; start the new model as another deployment "
        "(`splitserve up --name NAME`) and move clients to it, or " + _STOP_AND_UP,
        "store": "each node's store holds the state of requests in flight; " + _STOP_AND_UP,
        "gateway": "the gateway would restart and drop the connections it holds; " + _STOP_AND_UP,
    }
    for section, reason in reasons.items():
        changed = changed_keys(getattr(running, section), getattr(new, section), section)
        if changed:
            found.append(f"{section} cannot change live ({'; '.join(changed)}): {reason}")
    if not found:  # the gateway's settings are derived from the sections above too: say it once
        old_settings, new_settings = gateway_settings(running), gateway_settings(new)
        changed = [
            _change(key, old_settings.get(key), new_settings.get(key))
            for key in sorted(set(old_settings) | set(new_settings))
            if key not in _GATEWAY_SETTINGS_CONTROLLER_OWNS and old_settings.get(key) != new_settings.get(key)
        ]
        if changed:
            found.append(
                f"the gateway's settings would change ({'; '.join(changed)}): it was started with them "
                f"and cannot take new ones live (router, prefix caching, fallback and failover keys, "
                f"the longest request the pools serve); {_STOP_AND_UP}"
            )
    return found


def changed_keys(old: BaseModel, new: BaseModel, prefix: str) -> list[str]:
    """Each leaf key that differs, as "prefix.key: old -> new" (secrets as "changed")."""
    found = []
    for name in type(old).model_fields:
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if isinstance(before, BaseModel) and isinstance(after, BaseModel):
            found += changed_keys(before, after, f"{prefix}.{name}")
        else:
            found.append(_change(f"{prefix}.{name}", before, after))
    return found


def _change(key: str, before: Any, after: Any) -> str:
    if key.rpartition(".")[2] in SECRET_KEYS:
        return f"{key}: changed"
    return f"{key}: {_shown(before)} -> {_shown(after)}"


def _shown(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:g}"
    return repr(value)


def describe_plan(pools: Mapping[str, Pool], targets: list[PoolTarget]) -> list[str]:
    """One line per pool that changes: what an apply will do to it."""
    lines = []
    for target in targets:
        pool = pools[target.name]
        current = len(pool.members)
        outdated = [m for m in pool.members if m.spec != target.spec]
        if current > target.replicas:
            gone = ": the pool goes" if target.replicas == 0 else ", outdated ones first"
            lines.append(
                f"{target.name}: drain and remove {current - target.replicas} replica(s) "
                f"({current} -> {target.replicas}){gone}"
            )
        num_rolled = min(len(outdated), target.replicas)
        if num_rolled:
            reference = outdated[0].spec
            changes = reference.differences(target.spec) if reference is not None else {}
            what = "; ".join(_change(k, a, b) for k, (a, b) in changes.items())
            lines.append(
                f"{target.name}: roll {num_rolled} replica(s), one at a time: start one of the new spec, "
                f"then drain one of the old ({what or 'a new spec'})"
            )
        if current < target.replicas:
            lines.append(
                f"{target.name}: add {target.replicas - current} replica(s) ({current} -> {target.replicas})"
            )
    return lines
