"""Acting on a running deployment from another process: `splitserve status`, `resize`, `apply`.

Each finds one deployment, never whatever Ray runs on the machine: with `address`, the
deployment `name` (default `default`) in that Ray cluster; else the one recorded on this
machine (`name`, or the only one running: `splitserve up` records it); with none recorded, the
Ray in `$RAY_ADDRESS` (e.g. inside a KubeRay pod). Each disconnects when done; the deployment
keeps running.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import ray

from deploy.cluster_error import ClusterError
from deploy.controller import CONTROLLER_NAME
from deploy.launcher import STATUS_TIMEOUT_S, deployment_paths, error_cause, wait_for
from deploy.local_deployments import (
    DEFAULT_NAME,
    find_deployment,
    name_of,
    namespace_for,
    running_deployments,
)
from deploy.ray_connection import attach, gcs_reachable
from splitserve.config import ClusterConfig
from splitserve.rpc_auth import set_cluster_token

__all__ = ["ClusterError", "apply_config", "connect_to_controller", "fetch_status", "resize_pool"]

PROGRESS_POLL_S = 1.0  # how often a waiting `apply` reads the controller's progress


def connect_to_controller(name: str | None = None, address: str | None = None) -> tuple[Any, str]:
    """Attach to one deployment's controller (see the module docstring); return it and the Ray address."""
    address, namespace = _locate(name, address)
    return _attach_controller(address, namespace, name), address


def fetch_status(name: str | None = None, address: str | None = None) -> dict[str, Any]:
    """One deployment's `status()` (`splitserve status`)."""
    try:
        controller, ray_address = connect_to_controller(name, address)
        return wait_for(controller.status.remote(), ray_address, STATUS_TIMEOUT_S)  # type: ignore[no-any-return]
    finally:
        ray.shutdown()  # disconnects; the cluster itself keeps running


def resize_pool(
    pool: str, replicas: int, name: str | None = None, address: str | None = None
) -> dict[str, Any]:
    """Resize a pool of one deployment (`splitserve resize`); its status after."""
    try:
        controller, ray_address = connect_to_controller(name, address)
        try:
            return wait_for(controller.resize.remote(pool, replicas), ray_address, None)  # type: ignore[no-any-return]
        except ray.exceptions.RayTaskError as exc:
            raise ClusterError(error_cause(exc)) from None
    finally:
        ray.shutdown()


def apply_config(
    config: ClusterConfig,
    name: str | None = None,
    address: str | None = None,
    *,
    dry_run: bool = False,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Converge one deployment on `config` (`splitserve apply`); return {"plan": ..., "status": ...}.

    `on_progress` is given the controller's `status()["apply"]` about once a second while it
    works. A refusal or a failed step is a ClusterError with the controller's reason.
    """
    try:
        ray_address, namespace = _locate(name, address)
        controller = _attach_controller(ray_address, namespace, name)
        config = deployment_paths(config, name_of(namespace))  # as `up` filled in the running one
        ref = controller.apply.remote(config, dry_run)
        try:
            while not ray.wait([ref], timeout=PROGRESS_POLL_S)[0]:
                if not gcs_reachable(ray_address):
                    raise ClusterError(f"the Ray cluster at {ray_address} is gone")
                if on_progress is not None:
                    on_progress(wait_for(controller.status.remote(), ray_address, STATUS_TIMEOUT_S)["apply"])
            return ray.get(ref)  # type: ignore[no-any-return]
        except ray.exceptions.RayTaskError as exc:
            raise ClusterError(error_cause(exc)) from None
    finally:
        ray.shutdown()


def _locate(name: str | None, address: str | None) -> tuple[str, str]:
    """The Ray address and namespace of the deployment meant (see the module docstring)."""
    if address is None and name is None and not running_deployments():
        address = os.environ.get("RAY_ADDRESS") or None  # e.g. inside a KubeRay pod: no record, an address
    if address is not None:
        return address, namespace_for(name or DEFAULT_NAME)
    record = find_deployment(name)
    return record.address, record.namespace


def _attach_controller(address: str, namespace: str, name: str | None) -> Any:
    attach(address, namespace, log_to_driver=False, logging_level=logging.WARNING)
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        others = _other_deployments(namespace)
        up = "splitserve up" + ("" if name in (None, DEFAULT_NAME) else f" --name {name}")
        hint = f"it runs {others}: choose one with --name" if others else f"start the deployment with `{up}`"
        raise ClusterError(
            f"no splitserve controller in namespace {namespace!r} of the Ray cluster at {address} "
            f"(no actor {CONTROLLER_NAME!r}); {hint}"
        ) from None
    # An attached driver may call the workers and stores directly (a soak reads store Stats).
    with contextlib.suppress(Exception):  # a controller from before internal auth has no token
        set_cluster_token(wait_for(controller.cluster_token.remote(), address, 5.0))
    return controller


def _other_deployments(namespace: str) -> str:
    """The other deployments in this Ray cluster (namespaces holding a splitserve controller), as text."""
    try:
        actors = ray.util.list_named_actors(all_namespaces=True)
    except Exception:  # only a hint for the error message
        return ""
    found = sorted(
        a["namespace"] for a in actors if a["name"] == CONTROLLER_NAME and a["namespace"] != namespace
    )
    return ", ".join(f"deployment {name_of(ns)!r} (namespace {ns!r})" for ns in found)
