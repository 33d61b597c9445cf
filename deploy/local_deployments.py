"""The deployments `splitserve up` runs on this machine, each under its own name.

A deployment's name picks its Ray namespace (`splitserve` for the name `default`, else
`splitserve-NAME`), the temp dir of the local Ray that `up` starts for it, and its record.
Everything lives in a per-user runtime dir, `$SPLITSERVE_RUNTIME_DIR` or
`<tmp>/splitserve-<uid>` (mode 0700):

    <name>.lock   held (flock) by the `up` process for as long as it runs
    <name>.json   written once the deployment is healthy: Ray address, namespace, gateway, pid
    <name>/       the temp dir of the local Ray `up` started (logs, sockets)

The lock is the truth about liveness: the kernel drops it however `up` dies, so a record whose
lock is free is stale. `splitserve status` and `resize` find their deployment here, never by
asking Ray which cluster happens to run on the machine.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.cluster_error import ClusterError
from deploy.controller import NAMESPACE

RUNTIME_DIR_ENV = "SPLITSERVE_RUNTIME_DIR"
DEFAULT_NAME = "default"
MAX_NAME_CHARS = 20
_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
# Ray puts Unix sockets at <temp>/session_<date>_<pid>/sockets/plasma_store: 63 characters past
# <temp> at most, and a socket path holds 107.
_MAX_RAY_TEMP_DIR_CHARS = 107 - 64


def check_name(name: str) -> str:
    """`name` if it can name a deployment (lowercase letters, digits, '-'; at most 20), else ClusterError."""
    if len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name):
        raise ClusterError(
            f"deployment name {name!r}: use lowercase letters, digits and '-' (at most {MAX_NAME_CHARS}, "
            "starting with a letter or digit)"
        )
    return name


def namespace_for(name: str) -> str:
    """The Ray namespace of the deployment `name`: its controller and every actor it starts."""
    return NAMESPACE if check_name(name) == DEFAULT_NAME else f"{NAMESPACE}-{name}"


def name_of(namespace: str) -> str:
    """The deployment name whose namespace is `namespace` (the inverse of `namespace_for`)."""
    return DEFAULT_NAME if namespace == NAMESPACE else namespace.removeprefix(f"{NAMESPACE}-")


def runtime_dir() -> Path:
    """This user's folder of deployment records and local Ray temp dirs (created, 0700, checked)."""
    configured = os.environ.get(RUNTIME_DIR_ENV)
    path = (
        Path(configured).expanduser()
        if configured
        else Path(tempfile.gettempdir()) / f"splitserve-{os.getuid()}"
    )
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ClusterError(
            f"{path} is not a folder of this user's (uid {os.getuid()}); set {RUNTIME_DIR_ENV} to one that is"
        )
    return path


def ray_temp_dir(name: str) -> Path:
    """The temp dir for the local Ray that `up` starts for deployment `name`."""
    path = runtime_dir() / check_name(name)
    if len(str(path)) > _MAX_RAY_TEMP_DIR_CHARS:
        raise ClusterError(
            f"the Ray temp dir {path} is too long for Ray's Unix sockets (at most {_MAX_RAY_TEMP_DIR_CHARS} "
            f"characters); set {RUNTIME_DIR_ENV} to a shorter folder, or use a shorter --name"
        )
    return path


@dataclass(frozen=True)
class DeploymentRecord:
    """What `status` and `resize` need to find a deployment that `up` started on this machine."""

    name: str
    namespace: str
    address: str  # the Ray GCS (host:port) or Ray Client (ray://) address
    gateway_url: str | None
    pid: int  # of the `splitserve up` process
    started_ray: bool  # whether `up` started that Ray itself (it ends with `up`)

    def describe(self) -> str:
        return f"{self.name!r} (Ray at {self.address}, gateway {self.gateway_url}, `up` pid {self.pid})"


class DeploymentClaim:
    """Owns a deployment name on this machine while `splitserve up` runs, and its record.

    `DeploymentClaim(name)` takes `<name>.lock` or raises ClusterError naming the running
    deployment that holds it. `publish(record)` writes `<name>.json` (atomically); `release()`
    deletes it and drops the lock. The lock file itself stays: deleting a lock file another
    process may have just opened would let two processes hold "the" lock at once.
    """

    def __init__(self, name: str) -> None:
        self.name = check_name(name)
        directory = runtime_dir()
        self._record_path = directory / f"{name}.json"
        self._fd: int | None = os.open(directory / f"{name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        if not _try_lock(self._fd, attempts=10):
            os.close(self._fd)
            self._fd = None
            running = read_record(self._record_path)
            what = running.describe() if running else f"{name!r} (still starting)"
            raise ClusterError(
                f"a deployment named {what} is already running on this machine; stop it, or give this "
                "one another name with --name"
            ) from None
        self._record_path.unlink(missing_ok=True)  # left by an `up` that died: stale

    def publish(self, record: DeploymentRecord) -> None:
        staging = self._record_path.with_name(f".{self.name}.json.{os.getpid()}")
        staging.write_text(json.dumps(dataclasses.asdict(record), indent=2) + "\n", encoding="utf-8")
        os.replace(staging, self._record_path)

    def release(self) -> None:
        """Delete the record and drop the lock; idempotent."""
        if self._fd is None:
            return
        self._record_path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def read_record(path: Path) -> DeploymentRecord | None:
    """The record at `path`, or None if there is none (or it is unreadable)."""
    try:
        return DeploymentRecord(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def running_deployments() -> list[DeploymentRecord]:
    """The recorded deployments whose `up` is alive, by name; stale records are left alone."""
    directory = runtime_dir()
    return [
        record
        for path in sorted(directory.glob("*.json"))
        if (record := read_record(path)) is not None and _is_held(directory / f"{record.name}.lock")
    ]


def find_deployment(name: str | None) -> DeploymentRecord:
    """The running deployment `name`, or the only one running here when `name` is None."""
    directory = runtime_dir()
    if name is not None:
        record = read_record(directory / f"{check_name(name)}.json")
        if record is None or not _is_held(directory / f"{name}.lock"):
            others = ", ".join(r.name for r in running_deployments()) or "none"
            raise ClusterError(
                f"no deployment named {name!r} is running on this machine (running here: {others}; "
                f"records in {directory}); start it with `splitserve up --name {name}`, or pass --address"
            )
        return record
    running = running_deployments()
    if not running:
        raise ClusterError(
            f"no splitserve deployment is running on this machine (none recorded in {directory}); start "
            "one with `splitserve up`, or pass --address of a Ray cluster that runs one"
        )
    if len(running) > 1:
        raise ClusterError(
            f"{len(running)} deployments are running on this machine: "
            f"{'; '.join(r.describe() for r in running)}; choose one with --name"
        )
    return running[0]


def _try_lock(fd: int, attempts: int = 1) -> bool:
    """Take the exclusive flock on `fd`; retried briefly, as `_is_held` takes a free lock for a moment."""
    for attempt in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < attempts:
                time.sleep(0.05)
    return False


def _is_held(lock_path: Path) -> bool:
    """True while some process holds the flock on `lock_path` (its `up` is alive)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        return not _try_lock(fd)
    finally:
        os.close(fd)  # drops the lock if this probe took it
