"""Start a deployment from a `ClusterConfig` and get a handle that stops it.

`run_cluster(config, name=...)` connects to Ray (`address`, else `$RAY_ADDRESS`, else a fresh
local Ray with room to grow (`local_ray_num_cpus`), its temp dir this deployment's own), starts the controller as the
named actor `splitserve-controller` in the deployment's namespace (`local_deployments.namespace_for`),
waits until every actor is up and healthy, and returns a `ClusterHandle`. `handle.stop()` ends
every actor, the controller, and Ray itself only if `run_cluster` started it; it waits on Ray only
while Ray's GCS is there to answer, so a Ray killed along with this process (SIGTERM to the
process group) costs no timeouts. The controller is not detached: if the driver dies, Ray ends
it and everything it owns.

Acting on a running deployment from another process (`status`, `resize`, `apply`) is
deploy/control.py.
"""

from __future__ import annotations

import contextlib
import getpass
import math
import os
import time
from pathlib import Path
from typing import Any

import ray

from deploy.cluster_error import ClusterError
from deploy.controller import CONTROLLER_NAME, HEAD_NODE_RESOURCE, Controller
from deploy.local_deployments import DEFAULT_NAME, name_of, namespace_for, ray_temp_dir
from deploy.ray_connection import attach, ensure_auth_token, gcs_reachable, limit_shutdown_flush
from deploy.worker_spec import bundle_of
from frontend.server import GatewayBindError, bind_listening_socket
from splitserve.config import ClusterConfig, gateway_api_keys
from splitserve.rpc_auth import cluster_token, new_cluster_token, set_cluster_token

__all__ = ["ClusterError", "ClusterHandle", "run_cluster"]

STATUS_TIMEOUT_S = 30.0
# a local Ray holds at least this many times the CPUs and custom resources the config reserves
LOCAL_RAY_HEADROOM = 2
_LIVENESS_POLL_S = 0.5  # how often a wait on the controller checks that Ray's GCS is still there


class RayGoneError(ClusterError):
    """Ray's GCS stopped answering while this process waited on the deployment."""


class ClusterHandle:
    """A running deployment: its controller, the Ray address and namespace it runs in, and whether
    this process started that Ray (then `stop()` ends it)."""

    def __init__(
        self,
        controller: Any,
        *,
        started_ray: bool,
        stop_timeout_s: float,
        address: str = "auto",
        namespace: str | None = None,
    ) -> None:
        self.controller = controller
        self.started_ray = started_ray
        self.cluster_token: str | None = None  # set once the controller has it (never log it)
        self.address = address
        self.namespace = namespace or namespace_for(DEFAULT_NAME)
        self._stop_timeout_s = stop_timeout_s
        self._stopped = False

    def status(self, timeout_s: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
        return wait_for(self.controller.status.remote(), self.address, timeout_s)  # type: ignore[no-any-return]

    def resize(self, pool: str, replicas: int) -> dict[str, Any]:
        return wait_for(self.controller.resize.remote(pool, replicas), self.address, None)  # type: ignore[no-any-return]

    def apply(self, config: ClusterConfig, dry_run: bool = False) -> dict[str, Any]:
        """Converge on `config` (`Controller.apply`): {"plan": [...], "status": ...}."""
        config = deployment_paths(config, name_of(self.namespace))
        return wait_for(self.controller.apply.remote(config, dry_run), self.address, None)  # type: ignore[no-any-return]

    @property
    def gateway_url(self) -> str | None:
        gateway = self.status()["gateway"]
        return gateway["url"] if gateway else None

    def stop(self) -> None:
        """Stop every actor and the controller; shut Ray down if `run_cluster` started it. Idempotent.

        If Ray's GCS is gone (a SIGTERM to the process group ends the local Ray with this
        process), it waits on nothing: what is left of a local Ray is killed, and this process
        stays attached to the dead Ray, since `ray.shutdown()` would then wait for many seconds
        or end the process from inside Ray. Such a process should exit
        (`ray_connection.attached_to_lost_ray()` tells); `splitserve up` does.
        """
        if self._stopped:
            return
        self._stopped = True
        if self.cluster_token is not None and cluster_token() == self.cluster_token:
            set_cluster_token(None)  # the deployment is gone: this process holds no token for it
        ray_alive = gcs_reachable(self.address)
        try:
            if ray_alive:
                wait_for(self.controller.stop.remote(), self.address, self._stop_timeout_s)
        except RayGoneError:
            ray_alive = False
        except Exception:  # a dead or stuck controller: killing it ends the actors it owns
            pass
        finally:
            if not ray_alive:
                if self.started_ray:
                    _kill_local_ray()
            else:
                with contextlib.suppress(Exception):
                    ray.kill(self.controller, no_restart=True)
                if self.started_ray:
                    ray.shutdown()

    def __enter__(self) -> ClusterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def required_resources(config: ClusterConfig) -> dict[str, float]:
    """The logical CPUs, GPUs and pools' custom resources the whole deployment reserves (one
    store and the gateway processes, as on one node; a bundle per rank of each replica)."""
    need = {"CPU": config.gateway.num_cpus * config.gateway.replicas + config.store.num_cpus, "GPU": 0.0}
    for name in config.pool_names:
        pool = config.pool(name)
        for resource, amount in bundle_of(pool).items():
            need[resource] = need.get(resource, 0.0) + pool.replicas * pool.tensor_parallel * amount
    return need


def local_ray_num_cpus(config: ClusterConfig) -> int:
    """The logical CPUs of the local Ray `up` starts: this machine's cores, and at least twice what
    the config reserves, so `resize` and `apply` can grow every pool (a rolling replacement needs
    one replica's room beside the pool). Logical CPUs cost Ray nothing; the cores are shared
    however many there are."""
    need_cpus = required_resources(config)["CPU"]
    return max(os.cpu_count() or 1, math.ceil(LOCAL_RAY_HEADROOM * need_cpus), 1)


def local_ray_custom_resources(config: ClusterConfig) -> dict[str, float]:
    """The pools' custom resources (`<pool>.resources`) of the local Ray `up` starts, with the
    same headroom as its CPUs: a pool pinned by them can grow and roll on one machine too."""
    need = required_resources(config)
    return {name: LOCAL_RAY_HEADROOM * amount for name, amount in need.items() if name not in ("CPU", "GPU")}


def _kill_local_ray() -> None:
    """SIGKILL what is left of the local Ray this process started, whose GCS is already gone.

    Without their GCS they have nothing left to finish; a raylet whose GCS alone was killed
    would otherwise run on, and the others take seconds to exit on the group's SIGTERM.
    """
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None:
        with contextlib.suppress(Exception):
            node.kill_all_processes(check_alive=False, allow_graceful=False)


def wait_for(ref: Any, address: str, timeout_s: float | None) -> Any:
    """`ray.get(ref)`, checking every half second that the GCS at `address` still answers.

    Raises RayGoneError as soon as it does not (instead of Ray's 60 s reconnect), ClusterError
    after `timeout_s` (None: no limit), and whatever the call raised.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = (
            _LIVENESS_POLL_S
            if deadline is None
            else max(0.0, min(_LIVENESS_POLL_S, deadline - time.monotonic()))
        )
        if ray.wait([ref], timeout=left)[0]:
            return ray.get(ref)
        if not gcs_reachable(address):
            raise RayGoneError(
                f"the Ray cluster at {address} is gone (its GCS no longer accepts connections)"
            )
        if deadline is not None and time.monotonic() >= deadline:
            raise ClusterError(f"the splitserve controller did not answer within {timeout_s:g} s")


def run_cluster(
    config: ClusterConfig,
    *,
    address: str | None = None,
    name: str = DEFAULT_NAME,
    actor_classes: dict[str, type] | None = None,
) -> ClusterHandle:
    """Start the deployment `name` and wait until it is healthy. `actor_classes` is for test doubles."""
    namespace = namespace_for(name)
    on_this_machine = not (ray.is_initialized() or address or os.environ.get("RAY_ADDRESS"))
    check_memory_plan(config, detect_device=on_this_machine)
    started_ray, ray_address = _connect(config, address, name)
    handle: ClusterHandle | None = None
    token = new_cluster_token()  # this deployment's internal gRPC secret: to Ray only, never logged
    try:
        controller = _create_controller(deployment_paths(config, name), namespace, actor_classes, token)
        handle = ClusterHandle(
            controller,
            started_ray=started_ray,
            stop_timeout_s=4 * config.health.timeout_s + config.health.drain_timeout_s + 30,
            address=ray_address,
            namespace=namespace,
        )
        set_cluster_token(token)  # this process may call the workers and stores directly too
        handle.cluster_token = token
        wait_for(controller.start.remote(), ray_address, None)
        _wait_healthy(handle, config.health.start_timeout_s)
        return handle
    except BaseException as exc:  # Ctrl-C included: end whatever was started, then re-raise
        if handle is not None:
            handle.stop()
        elif started_ray:
            ray.shutdown()
        if isinstance(exc, Exception) and not isinstance(exc, ClusterError):
            raise ClusterError(f"the cluster did not start: {error_cause(exc)}") from None
        raise


def deployment_paths(config: ClusterConfig, name: str) -> ClusterConfig:
    """`config` with `{user}` and `{deployment}` in the store's disk path filled in."""
    path = config.store.disk.path
    if path is None or "{" not in path:
        return config
    filled = path.replace("{user}", _user_name()).replace("{deployment}", name)
    disk = config.store.disk.model_copy(update={"path": filled})
    return config.model_copy(update={"store": config.store.model_copy(update={"disk": disk})})


def _user_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid with no passwd entry (some containers)
        return str(os.getuid())


def _connect(config: ClusterConfig, address: str | None, name: str) -> tuple[bool, str]:
    """Connect to Ray; return whether this call started a local Ray (so stop() ends it) and its address."""
    namespace = namespace_for(name)
    if ray.is_initialized():
        return False, _gcs_address()
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        attach(target, namespace)
        return False, target
    check_local_model(config)
    try:  # the local Ray inherits this environment: a variable or file of API keys missing here fails there
        gateway_api_keys(config.gateway)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    if config.gateway.port:  # the gateway will run here: say the port is taken before models load
        try:
            bind_listening_socket(config.gateway.host, config.gateway.port).close()
        except GatewayBindError as exc:
            raise ClusterError(str(exc)) from None
    need = required_resources(config)
    temp_dir = ray_temp_dir(name)
    limit_shutdown_flush()
    ensure_auth_token()
    ray.init(
        num_cpus=local_ray_num_cpus(config),
        resources=local_ray_custom_resources(config),
        include_dashboard=False,
        namespace=namespace,
        _temp_dir=str(temp_dir),
    )
    have = ray.cluster_resources().get("GPU", 0.0)
    if need["GPU"] > have:
        ray.shutdown()
        raise ClusterError(
            f"the config reserves {need['GPU']:g} GPUs but this machine has {have:g}; set "
            f"num_gpus: 0 in the pools, or pass --address to use a Ray cluster with GPUs"
        )
    return True, _gcs_address()


def _gcs_address() -> str:
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # a Ray Client connection has no GCS address of its own
        return "auto"


def check_local_model(config: ClusterConfig) -> None:
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


def check_memory_plan(config: ClusterConfig, *, detect_device: bool) -> None:
    """Refuse a config whose memory plan (`splitserve config plan`) does not fit a pool's device.

    Planned only from a config.json readable here: model.path's (the embedded default's once it
    is built); otherwise there is nothing to plan from and nothing is refused. A pool's device
    memory is its `device_memory_bytes`, else, when the workers run on this machine
    (`detect_device`), this machine's GPU or RAM; a pool whose device is unknown is not refused.
    """
    from splitserve.default_model import DEFAULT_MODEL_NAME, cache_dir
    from splitserve.engine.model_config import KimiLinearModelConfig
    from splitserve.memory_plan import plan_cluster

    folder = Path(config.model.path).expanduser() if config.model.path else cache_dir() / DEFAULT_MODEL_NAME
    try:
        model = KimiLinearModelConfig.from_pretrained(folder)
    except (OSError, ValueError):  # no checkpoint here (check_local_model says so where it matters)
        return
    plans = plan_cluster(config, model, detect_device=detect_device)
    problems = [problem for plan in plans for problem in plan.problems()]
    if problems:
        raise ClusterError(
            "the memory plan does not fit (`splitserve config plan` shows it): " + "; ".join(problems)
        )


def _create_controller(
    config: ClusterConfig, namespace: str, actor_classes: dict[str, type] | None, cluster_token: str
) -> Any:
    try:
        ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        pass
    else:
        raise ClusterError(
            f"a splitserve deployment is already running in this Ray cluster (actor "
            f"{CONTROLLER_NAME!r} in namespace {namespace!r}); stop it first, or give this one "
            "another --name"
        )
    return (
        ray.remote(Controller)
        .options(
            name=CONTROLLER_NAME,
            namespace=namespace,
            num_cpus=0,
            max_restarts=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
        )
        .remote(config, actor_classes, cluster_token)
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


def error_cause(exc: BaseException) -> str:
    """The error inside a Ray task error (or `exc` itself), as one line."""
    cause = getattr(exc, "cause", None) or exc
    return str(cause) if isinstance(cause, ClusterError) else f"{type(cause).__name__}: {cause}"
