"""Start a deployment from a `ClusterConfig` and get a handle that stops it.

`run_cluster(config)` connects to Ray (`address`, else `$RAY_ADDRESS`, else a fresh local Ray
sized to the config), starts the controller as the named actor `splitserve-controller` in the
namespace `splitserve`, waits until every actor is up and healthy, and returns a
`ClusterHandle`. `handle.stop()` ends every actor, the controller, and Ray itself only if
`run_cluster` started it. The controller is not detached: if the driver dies, Ray ends it and
everything it owns.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import ray

from deploy.controller import CONTROLLER_NAME, HEAD_NODE_RESOURCE, NAMESPACE, Controller
from frontend.server import GatewayBindError, bind_listening_socket
from splitserve.config import ClusterConfig


class ClusterError(RuntimeError):
    """The deployment could not be started (or found): the message says why."""


class ClusterHandle:
    """A running deployment: its controller, and whether this process started Ray for it."""

    def __init__(self, controller: Any, *, started_ray: bool, stop_timeout_s: float) -> None:
        self.controller = controller
        self.started_ray = started_ray
        self._stop_timeout_s = stop_timeout_s
        self._stopped = False

    def status(self) -> dict[str, Any]:
        return ray.get(self.controller.status.remote())  # type: ignore[no-any-return]

    def resize(self, pool: str, replicas: int) -> dict[str, Any]:
        return ray.get(self.controller.resize.remote(pool, replicas))  # type: ignore[no-any-return]

    @property
    def gateway_url(self) -> str | None:
        gateway = self.status()["gateway"]
        return gateway["url"] if gateway else None

    def stop(self) -> None:
        """Stop every actor and the controller; shut Ray down if `run_cluster` started it. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            ray.get(self.controller.stop.remote(), timeout=self._stop_timeout_s)
        except Exception:  # a dead or stuck controller: killing it ends the actors it owns
            pass
        finally:
            with contextlib.suppress(Exception):
                ray.kill(self.controller, no_restart=True)
            if self.started_ray:
                ray.shutdown()

    def __enter__(self) -> ClusterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def required_resources(config: ClusterConfig) -> dict[str, float]:
    """The logical CPUs and GPUs the whole deployment reserves (one store, as on one node)."""
    cpus = config.gateway.num_cpus + config.store.num_cpus
    gpus = 0.0
    for name in config.pool_names:
        pool = config.pool(name)
        cpus += pool.replicas * pool.num_cpus
        gpus += pool.replicas * pool.num_gpus
    return {"CPU": cpus, "GPU": gpus}


def run_cluster(
    config: ClusterConfig,
    *,
    address: str | None = None,
    actor_classes: dict[str, type] | None = None,
) -> ClusterHandle:
    """Start the deployment and wait until it is healthy. `actor_classes` is for test doubles."""
    started_ray = _connect(config, address)
    handle: ClusterHandle | None = None
    try:
        controller = _create_controller(config, actor_classes)
        handle = ClusterHandle(
            controller,
            started_ray=started_ray,
            stop_timeout_s=4 * config.health.timeout_s + config.health.drain_timeout_s + 30,
        )
        ray.get(controller.start.remote())
        _wait_healthy(handle, config.health.start_timeout_s)
        return handle
    except BaseException as exc:  # Ctrl-C included: end whatever was started, then re-raise
        if handle is not None:
            handle.stop()
        elif started_ray:
            ray.shutdown()
        if isinstance(exc, Exception) and not isinstance(exc, ClusterError):
            raise ClusterError(f"the cluster did not start: {_cause(exc)}") from None
        raise


def connect_to_controller(address: str | None = None) -> Any:
    """Attach to a running deployment's controller (for `splitserve status`)."""
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=target, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise ClusterError(f"no Ray cluster at {target!r}: {exc}") from None
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ClusterError(
            f"no splitserve deployment is running in the Ray cluster at {target!r} "
            f"(no actor {CONTROLLER_NAME!r} in namespace {NAMESPACE!r}); start one with `splitserve up`"
        ) from None


def _connect(config: ClusterConfig, address: str | None) -> bool:
    """Connect to Ray; return True where this call started a local Ray (so stop() ends it)."""
    if ray.is_initialized():
        return False
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        ray.init(address=target, namespace=NAMESPACE)
        return False
    _check_local_model(config)
    if config.gateway.port:  # the gateway will run here: say the port is taken before models load
        try:
            bind_listening_socket(config.gateway.host, config.gateway.port).close()
        except GatewayBindError as exc:
            raise ClusterError(str(exc)) from None
    need = required_resources(config)
    ray.init(num_cpus=max(1, math.ceil(need["CPU"])), include_dashboard=False, namespace=NAMESPACE)
    have = ray.cluster_resources().get("GPU", 0.0)
    if need["GPU"] > have:
        ray.shutdown()
        raise ClusterError(
            f"the config reserves {need['GPU']:g} GPUs but this machine has {have:g}; set "
            f"num_gpus: 0 in the pools, or pass --address to use a Ray cluster with GPUs"
        )
    return True


def _check_local_model(config: ClusterConfig) -> None:
    """On a local Ray every worker reads the checkpoint from this machine: check it is there."""
    if config.model.path is None:  # the embedded default is built on first use
        return
    folder = Path(config.model.path).expanduser()
    if not (folder / "config.json").is_file():
        what = "is not a folder" if not folder.is_dir() else "has no config.json"
        raise ClusterError(
            f"model.path {config.model.path!r} {what} on this machine; point it at a checkpoint folder "
            "(one that save_pretrained wrote)"
        )


def _create_controller(config: ClusterConfig, actor_classes: dict[str, type] | None) -> Any:
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise ClusterError(
            f"a splitserve deployment is already running in this Ray cluster (actor "
            f"{CONTROLLER_NAME!r} in namespace {NAMESPACE!r}); stop it first"
        )
    return (
        ray.remote(Controller)
        .options(
            name=CONTROLLER_NAME,
            namespace=NAMESPACE,
            num_cpus=0,
            max_restarts=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
        )
        .remote(config, actor_classes)
    )


def _wait_healthy(handle: ClusterHandle, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = handle.status()
        if status["healthy"]:
            return
        if time.monotonic() > deadline:
            from deploy.report import unhealthy_parts

            raise ClusterError(f"not healthy after {timeout_s:g} s: {unhealthy_parts(status)}")
        time.sleep(0.2)


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    return str(cause) if isinstance(cause, ClusterError) else f"{type(cause).__name__}: {cause}"


def fetch_status(address: str | None = None) -> dict[str, Any]:
    """The running deployment's `status()`, from another process (`splitserve status`)."""
    try:
        controller = connect_to_controller(address)
        return ray.get(controller.status.remote(), timeout=60)  # type: ignore[no-any-return]
    finally:
        ray.shutdown()  # disconnects; the cluster itself keeps running


def resize_pool(pool: str, replicas: int, address: str | None = None) -> dict[str, Any]:
    """Resize a pool of the running deployment from another process (`splitserve resize`)."""
    try:
        controller = connect_to_controller(address)
        try:
            return ray.get(controller.resize.remote(pool, replicas))  # type: ignore[no-any-return]
        except ray.exceptions.RayTaskError as exc:
            raise ClusterError(_cause(exc)) from None
    finally:
        ray.shutdown()
