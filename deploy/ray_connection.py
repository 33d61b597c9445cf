"""Connecting this process to a Ray cluster so that a failure takes seconds and names its cause.

`ray.init(address=...)` alone reports every failure late and alike: an address where nothing
listens hangs for minutes, and a cluster that wants Ray's token authentication (on by default
for a local Ray) fails after ~21 s with "Failed to connect", because Ray sends the user's token
only to a cluster it found itself (`address="auto"`). `attach()` checks in turn, each step
bounded by seconds: the address accepts TCP connections; its GCS answers, given this user's
token where one exists; then it connects.

`ensure_auth_token()` creates `~/.ray/auth_token` atomically before a local Ray starts. Ray
writes it in place when it is missing, so two first starts at once could each run with a
different token and lock the other out of its own deployment.

`gcs_reachable()` is the cheap probe a stopping deployment uses to skip waiting on a GCS that
is gone, and `attached_to_lost_ray()` tells a process it is left attached to such a Ray.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray

from deploy.cluster_error import ClusterError

CONNECT_TIMEOUT_S = 3.0
GCS_ANSWER_TIMEOUT_S = 10.0
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENVS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")
# At shutdown Ray's driver waits up to this long (5 s by default) to flush task events to the
# GCS, even when the GCS is gone; nothing a splitserve command records there is worth the wait.
_SHUTDOWN_FLUSH_ENV = "RAY_task_events_shutdown_flush_timeout_ms"
_SHUTDOWN_FLUSH_MS = "1000"


def host_port(address: str) -> tuple[str, int] | None:
    """`host:port` or `ray://host:port` split in two; None for anything else (e.g. "auto")."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def gcs_reachable(address: str, timeout_s: float = 1.0) -> bool:
    """True if something accepts connections at the GCS `address` (True when it cannot tell)."""
    target = host_port(address)
    if target is None:
        return True
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError:
        return False
    return True


def attached_to_lost_ray() -> bool:
    """True if this process is still connected to a Ray whose GCS no longer accepts connections."""
    if not ray.is_initialized():
        return False
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # a Ray Client connection: nothing local to tell from
        return False
    return not gcs_reachable(str(address))


def limit_shutdown_flush() -> None:
    """Cap Ray's shutdown flush for this process and the Ray processes it starts (unless set)."""
    os.environ.setdefault(_SHUTDOWN_FLUSH_ENV, _SHUTDOWN_FLUSH_MS)


def attach(address: str, namespace: str, **init_kwargs: Any) -> None:
    """Connect to the Ray cluster at `address` in `namespace`, or raise ClusterError saying why not."""
    limit_shutdown_flush()
    target = host_port(address)
    if address != "auto":
        if target is None:
            raise ClusterError(
                f"{address!r} is not a Ray address; give the GCS as host:port (`ray start --head` "
                "prints it) or a Ray Client address ray://host:10001"
            )
        _check_accepts_connections(address, target)
        if not address.startswith("ray://"):
            _use_token_if_available()
            _check_gcs_answers(address)
    try:
        ray.init(address=address, namespace=namespace, **init_kwargs)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
        raise ClusterError(f"could not connect to the Ray cluster at {address}: {exc}") from None


def ensure_auth_token() -> None:
    """Create `~/.ray/auth_token` if a local Ray will want it and it is missing; never replace one."""
    if os.environ.get(AUTH_MODE_ENV, "token").lower() != "token" or _token_from_env():
        return
    path = DEFAULT_TOKEN_PATH.expanduser()
    if path.exists():
        return
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".auth_token.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # the form `ray get-auth-token --generate` writes
        with contextlib.suppress(FileExistsError):  # another first start won: use its token
            os.link(staging, path)
    finally:
        os.unlink(staging)


def _check_accepts_connections(address: str, target: tuple[str, int]) -> None:
    try:
        socket.create_connection(target, timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        timed_out = isinstance(exc, TimeoutError)
        why = f"no answer within {CONNECT_TIMEOUT_S:g} s" if timed_out else (exc.strerror or str(exc))
        raise ClusterError(
            f"Ray at {address} is not reachable ({why}); check the address, and that the Ray cluster "
            "is running"
        ) from None


def _token_from_env() -> str | None:
    return next((name for name in TOKEN_ENVS if os.environ.get(name)), None)


def _token_source() -> str | None:
    """Where this process would read a Ray token from, or None if it has none."""
    if _token_from_env():
        return f"${_token_from_env()}"
    path = DEFAULT_TOKEN_PATH.expanduser()
    return str(path) if path.is_file() else None


def _use_token_if_available() -> None:
    """Send this user's token, as Ray itself does only for `address="auto"` (unless RAY_AUTH_MODE says)."""
    if os.environ.get(AUTH_MODE_ENV) is not None or _token_source() is None:
        return
    from ray._raylet import Config  # type: ignore[attr-defined]

    os.environ[AUTH_MODE_ENV] = "token"
    Config.initialize("")  # Ray caches its config; re-read so this process sees token mode


def _check_gcs_answers(address: str) -> None:
    """One authenticated GCS call, on a thread so a GCS that never answers costs seconds, not minutes."""
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            from ray._raylet import GcsClient  # type: ignore[attr-defined]

            GcsClient(address=address)  # asks the GCS for the cluster id
            outcome.append(None)
        except BaseException as exc:  # reported on the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=probe, name="splitserve-gcs-probe", daemon=True)
    thread.start()
    thread.join(GCS_ANSWER_TIMEOUT_S)
    if not outcome:
        raise ClusterError(
            f"{address} accepts connections but no Ray GCS answered there within {GCS_ANSWER_TIMEOUT_S:g} s; "
            "give the GCS address (`ray start --head` prints it)"
        )
    exc = outcome[0]
    if exc is None:
        return
    if isinstance(exc, ray.exceptions.AuthenticationError):
        raise ClusterError(_authentication_refused(address))
    raise ClusterError(f"no Ray GCS answers at {address} ({type(exc).__name__}: {exc}); check the address")


def _authentication_refused(address: str) -> str:
    source = _token_source()
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled":
        sent = f"this process sent no token ({AUTH_MODE_ENV}=disabled)"
    elif source is None:
        sent = "this process has no token"
    else:
        sent = f"it refused the token from {source}"
    return (
        f"the Ray cluster at {address} requires token authentication and {sent}; use the token the "
        f"cluster was started with (`ray get-auth-token` on its head node): put it in "
        f"{DEFAULT_TOKEN_PATH}, or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN"
    )
