"""`splitserve config`, the status table, and `splitserve up`'s signal handling (with fakes)."""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cli.main import main
from deploy import serve
from deploy.launcher import run_cluster
from deploy.local_deployments import RUNTIME_DIR_ENV
from deploy.report import status_line, status_table, unhealthy_parts
from tests.deploy.fakes import FAKE_CLASSES, REGISTRY_NAME, REGISTRY_NAMESPACE, Registry
from tests.deploy.helpers import is_dead, is_dead_controller, small_config
from tests.deploy.splitserve_process import run_splitserve


@pytest.fixture(autouse=True)
def own_runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Deployment records of this test only: `up` here never meets a deployment someone else runs."""
    path = tmp_path_factory.mktemp("runtime")
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(path))
    return path


def test_config_check_prints_the_validated_config(tmp_path, capsys):
    path = tmp_path / "ok.yaml"
    path.write_text("prefill: {replicas: 2}\nstore: {memory_bytes: 1GiB}\n")
    assert main(["config", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "replicas: 2" in out and "memory_bytes: 1GiB" in out
    assert f"{path}: OK (disaggregated, pools: prefill, decode)" in err


def test_config_check_prints_the_one_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("decode: {tensor_parallel: 4, placement: STRICT_SPREAD}\n")
    assert main(["config", "check", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (
        f"splitserve config check: {path}: decode: placement STRICT_SPREAD with tensor_parallel 4: a "
        "replica's ranks run on one node, so its bundles must be packed; use PACK or STRICT_PACK"
    )


def test_config_default_prints_the_embedded_default(capsys):
    assert main(["config", "default"]) == 0
    assert "mode: disaggregated" in capsys.readouterr().out


def test_up_with_a_bad_config_exits_2_before_touching_ray(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("gateway: {prot: 1}\n")
    assert main(["up", "--config", str(path)]) == 2
    assert "gateway.prot: unknown key (did you mean 'port'?)" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_up_on_a_taken_port_says_so_before_starting_ray(tmp_path, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = tmp_path / "taken.yaml"
        path.write_text(f"gateway: {{port: {port}}}\n")
        assert main(["up", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"gateway cannot listen on 127.0.0.1:{port}" in err and "gateway.port" in err
    assert not ray.is_initialized()


def test_up_with_a_missing_checkpoint_says_so_before_starting_ray(tmp_path, capsys):
    path = tmp_path / "missing.yaml"
    path.write_text(f"model: {{path: {tmp_path / 'no-such-model'}}}\n")
    assert main(["up", "--config", str(path)]) == 1
    assert "is not a folder on this machine" in capsys.readouterr().err
    assert not ray.is_initialized()


STATUS: dict[str, Any] = {
    "mode": "disaggregated",
    "model": "m",
    "healthy": False,
    "gateway": {
        "kind": "gateway", "index": 0, "address": "0.0.0.0:8000", "url": "http://10.0.0.1:8000",
        "node_ip": "10.0.0.1", "healthy": True, "restarts": 0, "given_up": False, "error": None, "stats": {},
    },
    "pools": {
        "prefill": {
            "role": "prefill", "replicas": 1, "num_healthy": 1, "restarts": 1,
            "workers": [{
                "kind": "prefill", "index": 0, "address": "10.0.0.1:5000", "node_ip": "10.0.0.1",
                "healthy": True, "restarts": 1, "given_up": False, "error": None,
                "stats": {"num_running": 3, "num_waiting": 1, "name": "x"},
            }],
        },
        "decode": {
            "role": "decode", "replicas": 1, "num_healthy": 0, "restarts": 3,
            "workers": [{
                "kind": "decode", "index": 0, "address": None, "node_ip": "10.0.0.2",
                "healthy": False, "restarts": 3, "given_up": True, "error": "actor died", "stats": {},
            }],
        },
    },
    "stores": [],
}  # fmt: skip


def test_the_status_table_has_a_row_per_actor_with_health_and_load():
    table = status_table(STATUS)
    lines = table.splitlines()
    assert lines[0] == "model m (disaggregated) - " + status_line(STATUS)
    assert status_line(STATUS) == "DEGRADED: prefill 1/1, decode 0/1, stores 0/0, gateway up; 4 restarts"
    assert lines[1].split() == ["POOL", "#", "ADDRESS", "NODE", "HEALTHY", "RESTARTS", "LOAD"]
    assert lines[2].split()[:3] == ["gateway", "0", "http://10.0.0.1:8000"]
    assert "running=3 waiting=1" in lines[3]
    assert "GAVE UP (actor died)" in lines[4]


def test_the_status_table_names_a_worker_holding_slots_with_nothing_running():
    leaking = copy.deepcopy(STATUS)
    worker = leaking["pools"]["prefill"]["workers"][0]
    worker["stats"] = {"num_running": 0, "num_idle_held_slots": 16}
    row = status_table(leaking).splitlines()[3]
    assert "yes (holds 16 state slots with nothing running)" in row


def test_the_status_table_lists_each_gateway_process_with_its_own_port_and_the_ledger():
    several = copy.deepcopy(STATUS)
    first = dict(several["gateway"], stats={"own_address": "0.0.0.0:41001"})
    second = dict(first, index=1, healthy=False, restarts=1, error="actor died", stats={})
    ledger = dict(first, kind="ledger", address="1a2b3c4d5e6f", url=None, stats={"num_waiting": 2})
    several.update(gateways=[first, second], ledger=ledger)
    assert status_line(several).endswith("stores 0/0, gateways 1/2; 5 restarts")
    lines = status_table(several).splitlines()
    assert lines[2].split()[:5] == ["gateway", "0", "http://10.0.0.1:8000", "(own", "0.0.0.0:41001)"]
    assert lines[3].split()[:3] == ["gateway", "1", "http://10.0.0.1:8000"] and "actor died" in lines[3]
    assert lines[4].split()[:3] == ["ledger", "0", "1a2b3c4d5e6f"] and "waiting=2" in lines[4]
    assert unhealthy_parts(several) == "decode 0 (actor died); gateway 1 (actor died)"


@pytest.fixture
def ray_with_registry(ray_cluster: None) -> Iterator[Any]:
    registry = Registry.options(name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE).remote()
    yield registry
    ray.kill(registry)


def _signal_twice() -> None:
    """SIGTERM then SIGINT at once, as when `timeout` relays a signal that was also sent directly."""
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)


def test_up_stops_everything_and_exits_0_on_sigterm(ray_with_registry, monkeypatch, capsys, own_runtime_dir):
    started: list[Any] = []

    def run_with_fakes(config: Any, *, address: str | None = None, name: str) -> Any:
        handle = run_cluster(config, address=address, name=name, actor_classes=FAKE_CLASSES)
        started.append(handle)
        threading.Timer(0.5, _signal_twice).start()
        return handle

    monkeypatch.setattr(serve, "run_cluster", run_with_fakes)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert serve.serve_forever(small_config(), poll_s=0.1) == 0
    out, err = capsys.readouterr()
    assert "gateway: http://127.0.0.1:" in out and "healthy: prefill 1/1, decode 1/1" in out
    assert "stopped" in err
    handles = [h for _, _, h in ray.get(ray_with_registry.get_handles.remote())]
    assert len(handles) == 4 and all(is_dead(h) for h in handles)
    assert is_dead_controller()
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert not (own_runtime_dir / "default.json").exists()  # the record goes with the deployment


def test_config_files_in_deploy_are_all_valid(capsys):
    for path in sorted((Path(__file__).resolve().parents[2] / "deploy" / "configs").rglob("*.yaml")):
        assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err


def test_config_check_says_when_the_checkpoint_is_not_on_this_machine(tmp_path, capsys):
    path = tmp_path / "elsewhere.yaml"
    path.write_text(f"model: {{path: {tmp_path / 'no-such-model'}}}\n")
    assert main(["config", "check", str(path)]) == 0  # valid: the nodes of a Ray cluster may have it
    err = capsys.readouterr().err
    assert "is not a folder on this machine" in err
    assert "`splitserve up` without --address refuses it here" in err


def test_status_resize_and_apply_from_another_process(ray_with_registry, tmp_path):
    with run_cluster(small_config(), actor_classes=FAKE_CLASSES) as cluster:
        address = ray.get_runtime_context().gcs_address
        result = run_splitserve("status", "--address", address)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].startswith("model fake-model (disaggregated) - healthy: prefill 1/1, decode 1/1")
        assert [line.split()[0] for line in lines[2:]] == ["gateway", "prefill", "decode", "store"]
        assert cluster.status()["healthy"]  # the other process only disconnected

        resize = run_splitserve("resize", "decode", "2", "--address", address)
        assert resize.returncode == 0, resize.stderr
        assert "decode 2/2" in resize.stdout
        assert len(cluster.status()["pools"]["decode"]["addresses"]) == 2
        refused = run_splitserve("resize", "decode", "0", "--address", address)
        assert refused.returncode == 1 and "decode.replicas: must be at least 1 (got 0)" in refused.stderr

        # apply finds the deployment as status does; a dry run prints the plan, a model change is refused
        shrunk = tmp_path / "shrunk.yaml"
        shrunk.write_text(small_config().to_yaml())
        dry = run_splitserve("apply", "--config", str(shrunk), "--address", address, "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.splitlines() == [
            "plan:",
            "  - decode: drain and remove 1 replica(s) (2 -> 1), outdated ones first",
            "dry run: nothing changed",
        ]
        moved = tmp_path / "moved.yaml"
        moved.write_text(small_config(model={"path": "/models/moved"}).to_yaml())
        refused = run_splitserve("apply", "--config", str(moved), "--address", address)
        assert refused.returncode == 1 and "model cannot change live" in refused.stderr
        assert len(cluster.status()["pools"]["decode"]["addresses"]) == 2


def test_status_without_a_deployment_says_so(ray_with_registry):
    address = ray.get_runtime_context().gcs_address
    result = run_splitserve("status", "--address", address)
    assert result.returncode == 1
    assert "no splitserve controller in namespace 'splitserve'" in result.stderr
    named = run_splitserve("status", "--address", address, "--name", "other")
    assert named.returncode == 1
    assert "no splitserve controller in namespace 'splitserve-other'" in named.stderr
    assert "splitserve up --name other" in named.stderr


# Runs in a fresh interpreter: the engine's packages refused, as on a base install.
_WITHOUT_THE_ENGINE = """
import sys
class RefuseEngine:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "transformers", "safetensors", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, RefuseEngine())
from cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", [["make-tiny-model", "{tmp}/tiny"], ["demo"]])
def test_a_command_that_needs_torch_says_so_in_one_line_on_a_base_install(command, tmp_path):
    args = [arg.format(tmp=tmp_path) for arg in command]
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_THE_ENGINE, *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"splitserve {command[0]}: needs the engine extra (torch is not installed here): pip install "
        "'splitserve[engine]' (with torch for this machine's hardware first: deploy/README.md, \"Installing\")"
    ]
