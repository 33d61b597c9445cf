"""A Ray cluster over two hosts (tests/netns.py), started as an operator starts one: `ray start
--head` on one host, `ray start --address` on the other, each with its node IP, its custom
resources and a temp dir of its own, the dashboard off. Token authentication stays on: both
hosts and every driver read the cluster's token from one file (`RAY_AUTH_TOKEN_PATH`), as nodes
that were each given a copy of the head's token would. The head's GCS port is free whatever
else runs on this machine, since a namespace has ports of its own.

`RoomHolder` is another job on the cluster holding some resources in a placement group of its
own until it is told to let go (Ray starts nothing in a bundle nobody uses)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import IO

from tests.netns import Host

GCS_PORT = 6379
REPO_ROOT = Path(__file__).resolve().parents[2]
_START_TIMEOUT_S = 300  # `ray start` takes 20-40 s on a busy 2-core machine
_OBJECT_STORE_BYTES = 100 * 2**20


def cluster_env(directory: Path) -> dict[str, str]:
    """The environment of every Ray process and driver of the cluster: its token (a new one, in
    `directory`) and this checkout's packages on the path."""
    token = directory / "ray_auth_token"
    token.write_text(secrets.token_hex(32), encoding="utf-8")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    path = env.get("PYTHONPATH")
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT),
    )
    return env


def start_head(
    host: Host, env: dict[str, str], temp_dir: Path, num_cpus: float, resources: dict[str, float]
) -> str:
    """`ray start --head` in `host`; its GCS address."""
    _ray_start(
        host, env, temp_dir, num_cpus, resources, "--head", f"--port={GCS_PORT}", "--include-dashboard=false"
    )
    return f"{host.ip}:{GCS_PORT}"


def join(
    host: Host,
    address: str,
    env: dict[str, str],
    temp_dir: Path,
    num_cpus: float,
    resources: dict[str, float],
) -> None:
    """`ray start --address` in `host`: a worker node of the cluster at `address`."""
    _ray_start(host, env, temp_dir, num_cpus, resources, f"--address={address}")


def _ray_start(
    host: Host, env: dict[str, str], temp_dir: Path, num_cpus: float, resources: dict[str, float], *args: str
) -> None:
    temp_dir.mkdir(parents=True, exist_ok=True)
    argv = host.command(
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        *args,
        f"--node-ip-address={host.ip}",
        f"--num-cpus={num_cpus:g}",
        f"--resources={json.dumps(resources)}",
        f"--temp-dir={temp_dir}",
        f"--object-store-memory={_OBJECT_STORE_BYTES}",
        "--disable-usage-stats",
    )
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=_START_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"`ray start` in {host.netns} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )


class RoomHolder:
    """A driver in `host` holding `bundle` in a placement group until `release()`."""

    def __init__(self, host: Host, address: str, env: dict[str, str], bundle: dict[str, float]) -> None:
        self.process = subprocess.Popen(
            host.command(sys.executable, "-m", "tests.deploy.room_holder", address, json.dumps(bundle)),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._expect("held")

    def release(self) -> None:
        """Remove the placement group (the room is free once this returns), then end the driver."""
        assert self.process.stdin is not None
        self.process.stdin.write("release\n")
        self.process.stdin.flush()
        self._expect("released")
        self.process.wait(timeout=60)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _expect(self, line: str) -> None:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        got = stdout.readline().strip()  # the holder answers or exits; its own ray.get has a timeout
        if got != line:
            self.kill()
            raise RuntimeError(f"the room holder said {got!r}, not {line!r}: {self.process.stderr.read()}")  # type: ignore[union-attr]
