"""`splitserve bench compare` for real: a colocated and a disaggregated deployment of the tiny model,
each on its own local Ray, with a config that cannot start between them. Both run every request,
the one that cannot start is reported, and nothing of any deployment is left running."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import ray
import yaml

from bench import compare
from bench.deployments import DeploymentStartError, RayLauncher, RunningDeployment
from bench.result import BenchmarkResult
from cli.main import main
from splitserve.config import ClusterConfig
from splitserve.tiny_model import make_tiny_model

NUM_PROMPTS = 6
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(400)


def write_configs(folder: Path, model_path: Path) -> dict[str, Path]:
    """The same two CPU workers colocated and disaggregated, and one asking for GPUs no machine has."""
    pools = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 8}
    common = {
        "model": {"path": str(model_path), "name": "tiny"},
        "gateway": {"host": "127.0.0.1", "port": 0},
        "store": {"memory_bytes": "64MiB", "disk": {"path": None}},
        "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 240},
    }
    configs = {
        "colocated": {**common, "mode": "colocated", "prefill": {**pools, "replicas": 2}, "decode": {"replicas": 0}},
        "needs-gpus": {**common, "mode": "disaggregated", "prefill": {**pools, "replicas": 4096, "num_gpus": 1}, "decode": pools},
        "disaggregated": {**common, "mode": "disaggregated", "prefill": pools, "decode": pools},
    }  # fmt: skip
    paths = {name: folder / f"{name}.yaml" for name in configs}
    for name, data in configs.items():
        paths[name].write_text(yaml.safe_dump(data))
    return paths


def processes_under(path: str) -> list[str]:
    """The live processes whose command line names `path` (Ray's session folder is under it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it exited while being read
            continue
        if path in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline[:160]}")
    return found


class CountingLauncher:
    """The real launcher, noting the processes under Ray's folder while each deployment is up and
    right after each stop returns (or each start fails)."""

    def __init__(self, ray_tmpdir: str) -> None:
        self.real = RayLauncher(None)
        self.ray_tmpdir = ray_tmpdir
        self.num_processes_while_up: list[int] = []
        self.left_after_stop: list[list[str]] = []

    def start(self, config: ClusterConfig) -> RunningDeployment:
        try:
            deployment = self.real.start(config)
        except DeploymentStartError:
            self.left_after_stop.append(processes_under(self.ray_tmpdir))
            raise
        self.num_processes_while_up.append(len(processes_under(self.ray_tmpdir)))
        return _Counted(deployment, self)


class _Counted:
    def __init__(self, deployment: RunningDeployment, launcher: CountingLauncher) -> None:
        self.deployment, self.launcher = deployment, launcher

    @property
    def gateway_url(self) -> str:
        return self.deployment.gateway_url

    def stop(self) -> None:
        self.deployment.stop()
        self.launcher.left_after_stop.append(processes_under(self.launcher.ray_tmpdir))


@pytest.fixture
def ray_tmpdir(monkeypatch) -> Iterator[str]:
    """A short folder of its own for Ray's sessions (socket paths have a length limit)."""
    path = tempfile.mkdtemp(prefix="ssbc-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", path)
    monkeypatch.setenv("SPLITSERVE_RUNTIME_DIR", path)  # a local Ray a deployment starts lives here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # each deployment gets its own local Ray
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_compare_runs_both_deployments_reports_the_one_that_cannot_start_and_leaves_nothing(
    tmp_path, ray_tmpdir, monkeypatch, capsys
):
    assert not ray.is_initialized()
    configs = write_configs(tmp_path, make_tiny_model(tmp_path / "model", seed=3))
    launcher = CountingLauncher(ray_tmpdir)
    monkeypatch.setattr(compare, "make_launcher", lambda address: launcher)
    out = tmp_path / "out"

    status = main(
        ["bench", "compare", *(arg for path in configs.values() for arg in ("--config", str(path))),
         "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "16", "--random-output-len", "4",
         "--random-range-ratio", "0.5", "--max-concurrency", "3", "--goodput", "ttft:600000", "--disable-tqdm",
         "--output-dir", str(out)]
    )  # fmt: skip

    assert status == 1  # one deployment did not start
    doc = json.loads((out / "comparison.json").read_text())
    deployments = {d["label"]: d for d in doc["deployments"]}
    assert [d["label"] for d in doc["deployments"]] == ["colocated", "needs-gpus", "disaggregated"]
    assert deployments["needs-gpus"]["stage"] == "start"
    assert "reserves 4096 GPUs" in deployments["needs-gpus"]["error"]
    for label in ("colocated", "disaggregated"):
        entry = deployments[label]
        result = BenchmarkResult.load(out / entry["result_file"])
        assert entry["stage"] == "done", entry["error"]
        assert result.summary.completed == NUM_PROMPTS and result.summary.failed == 0
        assert all(r.output_tokens == r.max_tokens for r in result.records)
        assert result.summary.goodput_rps == result.summary.request_throughput_rps
    colocated, disaggregated = (
        BenchmarkResult.load(out / f"{label}.json") for label in ("colocated", "disaggregated")
    )
    assert [(r.prompt_tokens, r.max_tokens) for r in colocated.records] == [
        (r.prompt_tokens, r.max_tokens) for r in disaggregated.records
    ]  # the same workload
    for plot in doc["plots"]:
        assert (out / plot).read_bytes().startswith(PNG_SIGNATURE)
    assert doc["plots"] == ["latency_cdf.png", "throughput.png"]
    assert "needs-gpus: did not start" in capsys.readouterr().out

    # Nothing is left: no Ray connection, no gateway, no Ray or worker process.
    assert not ray.is_initialized()
    for label in ("colocated", "disaggregated"):
        url = urlsplit(deployments[label]["gateway_url"])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((url.hostname, url.port), timeout=5).close()
    assert len(launcher.num_processes_while_up) == 2 and min(launcher.num_processes_while_up) > 0
    # When stop() returns (or a start fails), the deployment's processes are gone: the next one
    # gets the CPUs to itself.
    assert launcher.left_after_stop == [[], [], []]
