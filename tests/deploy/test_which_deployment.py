"""Two deployments in one Ray (fake actors): `status` and `resize` act on the one they name, only.

Each deployment is recorded as `splitserve up --name` records it; the commands run as separate
processes, as a user runs them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from deploy.launcher import ClusterHandle, run_cluster
from deploy.local_deployments import RUNTIME_DIR_ENV, DeploymentClaim, DeploymentRecord
from tests.deploy.fakes import FAKE_CLASSES, REGISTRY_NAME, REGISTRY_NAMESPACE, Registry
from tests.deploy.helpers import small_config
from tests.deploy.splitserve_process import run_splitserve

# Two deployments and a third decode replica fit the module's 2 logical CPUs.
_SMALL = {
    "gateway": {"num_cpus": 0.1},
    "store": {"num_cpus": 0.1},
    "prefill": {"num_cpus": 0.2},
    "decode": {"num_cpus": 0.2},
}


Deployments = tuple[Path, dict[str, ClusterHandle]]


@pytest.fixture(scope="module")
def deployments(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployments]:
    """Deployments 'a' and 'b' running and recorded in a runtime dir of their own."""
    runtime_dir = tmp_path_factory.mktemp("runtime")
    registry = Registry.options(name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE).remote()
    handles: dict[str, ClusterHandle] = {}
    claims: list[DeploymentClaim] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RUNTIME_DIR_ENV, str(runtime_dir))
        try:
            for name in ("a", "b"):
                claim = DeploymentClaim(name)
                claims.append(claim)
                handles[name] = run_cluster(small_config(**_SMALL), name=name, actor_classes=FAKE_CLASSES)
                claim.publish(_record(name, handles[name]))
            yield runtime_dir, handles
        finally:
            for handle in handles.values():
                handle.stop()
            for claim in claims:
                claim.release()
            ray.kill(registry)


def _record(name: str, handle: ClusterHandle) -> DeploymentRecord:
    return DeploymentRecord(
        name=name,
        namespace=handle.namespace,
        address=handle.address,
        gateway_url=handle.gateway_url,
        pid=os.getpid(),
        started_ray=False,
    )


def num_decode(handle: ClusterHandle) -> int:
    return len(handle.status()["pools"]["decode"]["addresses"])


def test_each_deployment_has_its_own_namespace(deployments: Deployments):
    _, handles = deployments
    assert handles["a"].namespace == "splitserve-a" and handles["b"].namespace == "splitserve-b"
    assert handles["a"].gateway_url != handles["b"].gateway_url


def test_status_without_a_name_asks_which_of_the_running_deployments(deployments: Deployments):
    runtime_dir, _ = deployments
    result = run_splitserve("status", runtime_dir=str(runtime_dir))
    assert result.returncode == 1
    assert "2 deployments are running on this machine: 'a' (Ray at" in result.stderr
    assert "choose one with --name" in result.stderr


def test_resize_changes_the_named_deployment_and_no_other(deployments: Deployments):
    runtime_dir, handles = deployments
    assert num_decode(handles["a"]) == num_decode(handles["b"]) == 1
    resized = run_splitserve("resize", "decode", "2", "--name", "b", runtime_dir=str(runtime_dir))
    assert resized.returncode == 0, resized.stderr
    assert "decode 2/2" in resized.stdout
    assert num_decode(handles["b"]) == 2
    assert num_decode(handles["a"]) == 1
    status_a = run_splitserve("status", "--name", "a", runtime_dir=str(runtime_dir))
    assert status_a.returncode == 0, status_a.stderr
    assert "decode 1/1" in status_a.stdout.splitlines()[0]
    assert handles["a"].gateway_url in status_a.stdout


def test_an_address_without_a_name_lists_the_deployments_there(deployments: Deployments):
    _, handles = deployments
    result = run_splitserve("status", "--address", handles["a"].address)
    assert result.returncode == 1
    assert "no splitserve controller in namespace 'splitserve'" in result.stderr
    assert "it runs deployment 'a' (namespace 'splitserve-a'), deployment 'b'" in result.stderr
    named = run_splitserve("status", "--address", handles["a"].address, "--name", "b")
    assert named.returncode == 0, named.stderr
