"""Bringing a splitserve deployment up for a benchmark and taking it down again, clean each time.

`RayLauncher(address).start(config)` runs `deploy.launcher.run_cluster` (a fresh local Ray sized
to the config, or the Ray at `address` / `$RAY_ADDRESS`) and returns a `RunningDeployment`
once it is healthy; its `stop()` ends every actor and disconnects from Ray, so the next
deployment starts from nothing. Ray and the launcher load only inside these calls: importing
this module stays cheap and torch-free.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from splitserve.config import ClusterConfig

# How long a stopped deployment's controller may keep its name in a shared Ray cluster.
CONTROLLER_RELEASE_TIMEOUT_S = 30.0


class DeploymentStartError(RuntimeError):
    """The deployment did not come up (nothing of it is left running); the message says why."""


class RunningDeployment(Protocol):
    """A healthy deployment: where its OpenAI gateway listens, and how to end it (idempotent)."""

    @property
    def gateway_url(self) -> str: ...

    def stop(self) -> None: ...


class Launcher(Protocol):
    """Starts deployments: `start` returns one that is healthy, or raises `DeploymentStartError`."""

    def start(self, config: ClusterConfig) -> RunningDeployment: ...


class RayLauncher:
    """Starts each deployment with `run_cluster` on a Ray it connects to afresh.

    With `address` None (and no `$RAY_ADDRESS`) every deployment gets its own local Ray, which
    its `stop()` shuts down; with an address, `stop()` waits until the controller's name is free
    in that cluster and then disconnects, leaving the cluster itself running.
    """

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def start(self, config: ClusterConfig) -> RunningDeployment:
        import ray

        from deploy.launcher import ClusterError, run_cluster

        if ray.is_initialized():  # a connection left by something else: start clean
            ray.shutdown()
        try:
            handle = run_cluster(config, address=self.address)
        except ClusterError as exc:
            _disconnect()
            raise DeploymentStartError(str(exc)) from None
        deployment = _RayDeployment(handle)
        try:
            url = handle.gateway_url
        except BaseException:
            deployment.stop()
            raise
        if not url:
            deployment.stop()
            raise DeploymentStartError("the deployment reported healthy but has no gateway URL")
        deployment.url = url
        return deployment


class _RayDeployment:
    """One deployment `run_cluster` started; `stop()` ends it and leaves this process off Ray."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.url = ""

    @property
    def gateway_url(self) -> str:
        return self.url

    def stop(self) -> None:
        import ray

        try:
            self.handle.stop()  # shuts a local Ray down itself
            if ray.is_initialized():
                _wait_controller_released(CONTROLLER_RELEASE_TIMEOUT_S)
        finally:
            _disconnect()


def _wait_controller_released(timeout_s: float) -> None:
    """Wait (bounded) until no actor holds the controller's name, so the next start can take it."""
    import ray

    from deploy.controller import CONTROLLER_NAME, NAMESPACE

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)


def _disconnect() -> None:
    import ray

    with contextlib.suppress(Exception):
        if ray.is_initialized():
            ray.shutdown()
