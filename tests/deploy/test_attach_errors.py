"""`splitserve status` that cannot reach its deployment says why, in seconds, instead of hanging.

A Ray with token authentication runs in a child process with a token this test chose; each
`splitserve status` runs as its own process with the environment a user would have. The
subprocess timeout is the bound: a status that hangs fails the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local_deployments import RUNTIME_DIR_ENV
from tests.deploy.splitserve_process import run_splitserve

TOKEN = "5e" * 32
_RAY_HOLDER = """
import sys
import ray
ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1])
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes our stdin
ray.shutdown()
"""
_RAY_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def user_env(home: Path, runtime_dir: Path, **extra: str) -> dict[str, str]:
    """A shell's environment with no Ray settings, `home` as HOME and this test's runtime dir."""
    env = {k: v for k, v in os.environ.items() if k not in _RAY_ENV}
    return {**env, "HOME": str(home), RUNTIME_DIR_ENV: str(runtime_dir), **extra}


@pytest.fixture(scope="module")
def token_ray() -> Iterator[str]:
    """The GCS address of a Ray that requires the token TOKEN."""
    temp_dir = tempfile.mkdtemp(prefix="ss-ray-")  # short: Ray's socket paths must fit 107 bytes
    env = {**{k: v for k, v in os.environ.items() if k not in _RAY_ENV}, "RAY_AUTH_MODE": "token"}
    env["RAY_AUTH_TOKEN"] = TOKEN
    holder = subprocess.Popen(
        [sys.executable, "-c", _RAY_HOLDER, temp_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None
        address = holder.stdout.readline().strip()
        assert address, "the Ray holder printed no address"
        yield address
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A home folder whose ~/.ray/auth_token holds the cluster's token."""
    (tmp_path / "home" / ".ray").mkdir(parents=True)
    (tmp_path / "home" / ".ray" / "auth_token").write_text(TOKEN)
    return tmp_path / "home"


def test_the_users_token_reaches_a_cluster_named_by_address(token_ray, home, tmp_path):
    # Ray itself sends ~/.ray/auth_token only to a cluster it found by "auto"; this got through
    # authentication, so the error is the real one: no deployment there.
    result = run_splitserve("status", "--address", token_ray, env=user_env(home, tmp_path))
    assert result.returncode == 1
    assert "no splitserve controller in namespace 'splitserve'" in result.stderr
    assert "start the deployment with `splitserve up`" in result.stderr


def test_a_wrong_token_is_reported_as_refused_authentication(token_ray, home, tmp_path):
    env = user_env(home, tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="00" * 32)
    result = run_splitserve("status", "--address", token_ray, env=env)
    assert result.returncode == 1
    assert f"the Ray cluster at {token_ray} requires token authentication" in result.stderr
    assert "it refused the token from $RAY_AUTH_TOKEN" in result.stderr


def test_no_token_at_all_is_reported_as_missing(token_ray, tmp_path):
    result = run_splitserve("status", "--address", token_ray, env=user_env(tmp_path, tmp_path))
    assert result.returncode == 1
    assert "requires token authentication and this process has no token" in result.stderr


def test_an_address_where_nothing_listens_is_not_reachable(home, tmp_path):
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run_splitserve(
        "resize", "decode", "2", "--address", f"127.0.0.1:{port}", env=user_env(home, tmp_path)
    )
    assert result.returncode == 1
    assert f"Ray at 127.0.0.1:{port} is not reachable (Connection refused)" in result.stderr


def test_something_that_is_not_an_address_is_named(home, tmp_path):
    result = run_splitserve("status", "--address", "head-node", env=user_env(home, tmp_path))
    assert result.returncode == 1
    assert "'head-node' is not a Ray address" in result.stderr


def test_without_a_recorded_deployment_status_says_so_and_never_picks_a_ray(token_ray, home, tmp_path):
    # A Ray runs on this machine (token_ray), but no `splitserve up` recorded a deployment.
    result = run_splitserve("status", env=user_env(home, tmp_path))
    assert result.returncode == 1
    assert (
        f"no splitserve deployment is running on this machine (none recorded in {tmp_path})" in result.stderr
    )
