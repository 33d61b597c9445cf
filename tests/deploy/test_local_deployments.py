"""Deployments on one machine: names, the claim `up` holds, the records `status` reads, their paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deploy.cluster_error import ClusterError
from deploy.launcher import deployment_paths
from deploy.local_deployments import (
    RUNTIME_DIR_ENV,
    DeploymentClaim,
    DeploymentRecord,
    find_deployment,
    name_of,
    namespace_for,
    ray_temp_dir,
    running_deployments,
    runtime_dir,
)
from deploy.ray_connection import ensure_auth_token
from splitserve.config import default_config, parse_config


@pytest.fixture(autouse=True)
def own_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "runtime"
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(path))
    return path


def record(name: str, address: str = "10.0.0.1:6379") -> DeploymentRecord:
    return DeploymentRecord(
        name=name,
        namespace=namespace_for(name),
        address=address,
        gateway_url="http://127.0.0.1:8000",
        pid=os.getpid(),
        started_ray=True,
    )


def test_each_name_has_its_own_namespace_and_bad_names_are_refused():
    assert namespace_for("default") == "splitserve"  # what a deployment without --name always used
    assert namespace_for("team-a") == "splitserve-team-a"
    assert name_of("splitserve") == "default" and name_of("splitserve-team-a") == "team-a"
    for bad in ("Team", "a_b", "-a", "", "x" * 21, "../up"):
        with pytest.raises(ClusterError, match="deployment name"):
            namespace_for(bad)


def test_a_second_up_with_the_same_name_is_refused_while_the_first_runs(own_runtime_dir: Path):
    first = DeploymentClaim("a")
    first.publish(record("a"))
    with pytest.raises(ClusterError) as refused:
        DeploymentClaim("a")
    assert "a deployment named 'a' (Ray at 10.0.0.1:6379" in str(refused.value)
    assert "another name with --name" in str(refused.value)
    other = DeploymentClaim("b")  # another name is free
    first.release()
    assert not (own_runtime_dir / "a.json").exists()
    DeploymentClaim("a").release()  # and the name is free again
    other.release()


def test_status_finds_the_one_deployment_running_and_asks_to_choose_among_several():
    with pytest.raises(ClusterError, match="no splitserve deployment is running on this machine"):
        find_deployment(None)
    a, b = DeploymentClaim("a"), DeploymentClaim("b")
    a.publish(record("a", "10.0.0.1:1"))
    b.publish(record("b", "10.0.0.2:2"))
    with pytest.raises(ClusterError, match="2 deployments are running on this machine") as several:
        find_deployment(None)
    assert "choose one with --name" in str(several.value)
    assert find_deployment("b").address == "10.0.0.2:2"
    b.release()
    assert find_deployment(None) == record("a", "10.0.0.1:1")
    with pytest.raises(
        ClusterError, match=r"no deployment named 'b' is running on this machine \(running here: a"
    ):
        find_deployment("b")
    a.release()


def test_a_record_left_by_an_up_that_was_killed_is_not_running(own_runtime_dir: Path):
    # The child records a deployment, then dies by SIGKILL: nothing of it can clean up.
    code = textwrap.dedent(
        """
        import os, signal
        from deploy.local_deployments import DeploymentClaim, DeploymentRecord
        claim = DeploymentClaim("gone")
        claim.publish(DeploymentRecord("gone", "splitserve-gone", "10.0.0.9:6379", None, os.getpid(), True))
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, RUNTIME_DIR_ENV: str(own_runtime_dir)}
    child = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    assert child.returncode == -9
    assert json.loads((own_runtime_dir / "gone.json").read_text())["address"] == "10.0.0.9:6379"
    assert running_deployments() == []
    with pytest.raises(ClusterError, match="no deployment named 'gone' is running"):
        find_deployment("gone")
    DeploymentClaim("gone").release()  # the name is free; the stale record goes with the claim
    assert not (own_runtime_dir / "gone.json").exists()


def test_the_runtime_dir_is_private_and_must_be_a_folder_of_this_user(tmp_path: Path, monkeypatch):
    assert runtime_dir().stat().st_mode & 0o777 == 0o700
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)  # what another user could plant at a predictable path
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path / "link"))
    with pytest.raises(ClusterError, match=f"is not a folder of this user's.*set {RUNTIME_DIR_ENV}"):
        runtime_dir()


def test_a_ray_temp_dir_too_long_for_unix_sockets_is_refused(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(RUNTIME_DIR_ENV, "/tmp/ss")
    assert str(ray_temp_dir("team-a")) == "/tmp/ss/team-a"
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path / ("x" * 40)))
    with pytest.raises(ClusterError, match="too long for Ray's Unix sockets"):
        ray_temp_dir("team-a")


def test_the_store_disk_path_is_per_user_and_per_deployment_unless_the_config_says_otherwise():
    default = deployment_paths(default_config(), "team-a").store.disk.path
    assert (
        default is not None and default.startswith("/tmp/splitserve-store-") and default.endswith("/team-a")
    )
    assert "{" not in default
    assert deployment_paths(default_config(), "team-b").store.disk.path != default
    explicit = parse_config({"store": {"disk": {"path": "/nvme/store"}}})
    assert deployment_paths(explicit, "team-a").store.disk.path == "/nvme/store"


def test_the_ray_token_is_created_once_and_never_replaced(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    ensure_auth_token()
    token_path = tmp_path / ".ray" / "auth_token"
    token = token_path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    ensure_auth_token()
    assert token_path.read_text() == token
    assert sorted(p.name for p in token_path.parent.iterdir()) == ["auth_token"]  # no staging files left
    monkeypatch.setenv("HOME", str(tmp_path / "other"))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ensure_auth_token()
    assert not (tmp_path / "other" / ".ray").exists()
