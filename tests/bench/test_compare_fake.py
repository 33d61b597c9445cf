"""`splitserve bench compare` through `cli.main.main`, each "deployment" a fake OpenAI server
started and stopped by a fake launcher: the order of starts and stops, identical workloads,
failures reported while the others still run, Ctrl-C, labels."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import yaml

from bench import compare
from bench.compare import deployment_labels
from bench.deployments import DeploymentStartError
from bench.result import BenchmarkResult
from cli.main import main
from splitserve.config import ClusterConfig
from tests.bench.fake_server import FakeOpenAI, serving

NUM_PROMPTS = 6
OPTIONS = ["--num-prompts", str(NUM_PROMPTS), "--random-input-len", "12", "--random-output-len", "3",
           "--random-range-ratio", "0.5", "--seed", "9", "--request-rate", "50", "--disable-tqdm"]  # fmt: skip


class FakeDeployment:
    """A fake server that serves until `stop()`, which the launcher's log records."""

    def __init__(self, name: str, fake: FakeOpenAI, events: list[tuple[str, str]]) -> None:
        self.name, self.events = name, events
        self._stack = contextlib.ExitStack()
        self.url = self._stack.enter_context(serving(fake))

    @property
    def gateway_url(self) -> str:
        return self.url

    def stop(self) -> None:
        self._stack.close()
        self.events.append(("stop", self.name))


class FakeLauncher:
    """Starts a fresh fake server per config, named by the config's served model name; the names in
    `fail` raise DeploymentStartError and those in `interrupt` KeyboardInterrupt instead;
    `fake_options` are the FakeOpenAI arguments by name."""

    def __init__(self, fail: set[str], interrupt: set[str], fake_options: dict[str, dict]) -> None:
        self.fail, self.interrupt, self.fake_options = fail, interrupt, fake_options
        self.events: list[tuple[str, str]] = []
        self.fakes: dict[str, FakeOpenAI] = {}

    def start(self, config: ClusterConfig) -> FakeDeployment:
        name = config.model.served_name
        self.events.append(("start", name))
        if name in self.interrupt:
            raise KeyboardInterrupt
        if name in self.fail:
            raise DeploymentStartError(f"{name}: not healthy after 5 s")
        self.fakes[name] = FakeOpenAI(**self.fake_options.get(name, {}))
        return FakeDeployment(name, self.fakes[name], self.events)


@pytest.fixture
def launcher(monkeypatch) -> FakeLauncher:
    fake = FakeLauncher({"broken"}, {"stopper"}, {"always_failing": {"fail": lambda body: 500}})
    monkeypatch.setattr(compare, "make_launcher", lambda address: fake)
    return fake


def write_config(folder: Path, name: str) -> str:
    path = folder / f"{name}.yaml"
    data = {
        "model": {"path": str(folder / "no-model"), "name": name},
        "gateway": {"host": "127.0.0.1", "port": 0},
    }
    path.write_text(yaml.safe_dump(data))
    return str(path)


def run_compare(tmp_path: Path, *names: str, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    configs = [arg for name in names for arg in ("--config", write_config(tmp_path, name) if name != "missing" else str(tmp_path / "missing.yaml"))]  # fmt: skip
    status = main(["bench", "compare", *configs, "--output-dir", str(tmp_path / "out"), *OPTIONS, *extra])
    return status, json.loads((tmp_path / "out" / "comparison.json").read_text())


def sent_prompts(fake: FakeOpenAI) -> list[str]:
    return sorted(json.dumps(r.body["prompt"]) for r in fake.received)


def test_every_deployment_gets_the_same_workload_started_and_stopped_in_turn(launcher, tmp_path, capsys):
    status, doc = run_compare(tmp_path, "alpha", "beta")
    assert status == 0
    assert launcher.events == [("start", "alpha"), ("stop", "alpha"), ("start", "beta"), ("stop", "beta")]
    alpha, beta = launcher.fakes["alpha"], launcher.fakes["beta"]
    assert len(alpha.received) == len(beta.received) == NUM_PROMPTS
    assert sent_prompts(alpha) == sent_prompts(beta)
    assert {r.body["model"] for r in alpha.received} == {"alpha"}  # each gets its own served name
    assert {r.body["model"] for r in beta.received} == {"beta"}

    results = {
        d["label"]: BenchmarkResult.load(tmp_path / "out" / d["result_file"]) for d in doc["deployments"]
    }
    a, b = results["alpha"], results["beta"]
    assert a.summary.completed == b.summary.completed == NUM_PROMPTS
    assert [(r.prompt_tokens, r.max_tokens) for r in a.records] == [
        (r.prompt_tokens, r.max_tokens) for r in b.records
    ]
    assert a.arguments["label"] == "alpha" and a.arguments["base_url"] != b.arguments["base_url"]
    assert a.arguments["seed"] == b.arguments["seed"] == 9
    assert doc["arguments"]["configs"][0].endswith("alpha.yaml") and "api_key" not in doc["arguments"]
    assert doc["plots"] == ["latency_cdf.png", "throughput.png"]

    header = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:3] == ["alpha", "beta", "beta/alpha"])  # fmt: skip
    assert header


def test_a_config_that_does_not_load_or_a_start_that_fails_is_reported_and_the_rest_still_run(
    launcher, tmp_path, capsys
):
    status, doc = run_compare(tmp_path, "alpha", "missing", "broken", "beta")
    assert status == 1
    assert launcher.events == [("start", "alpha"), ("stop", "alpha"), ("start", "broken"), ("start", "beta"), ("stop", "beta")]  # fmt: skip
    stages = [(d["label"], d["stage"]) for d in doc["deployments"]]
    assert stages == [("alpha", "done"), ("missing", "config"), ("broken", "start"), ("beta", "done")]
    assert "cannot read the config file" in doc["deployments"][1]["error"]
    assert doc["deployments"][2]["error"] == "broken: not healthy after 5 s"
    assert [r["values"] for r in doc["rows"] if r["name"] == "Successful requests"] == [
        {"alpha": 6, "beta": 6}
    ]
    out = capsys.readouterr().out
    assert "missing: config did not load: " in out and "broken: did not start: broken: not healthy" in out


def test_a_deployment_whose_requests_all_fail_still_counts_as_run_but_the_exit_status_says_so(
    launcher, tmp_path
):
    status, doc = run_compare(tmp_path, "alpha", "always_failing")
    assert status == 1
    failing = doc["deployments"][1]
    assert failing["stage"] == "done" and failing["summary"]["failed"] == NUM_PROMPTS
    assert launcher.events[-1] == ("stop", "always_failing")


def test_ctrl_c_stops_what_runs_writes_what_finished_and_exits_130(launcher, tmp_path):
    status, doc = run_compare(tmp_path, "alpha", "stopper", "beta")
    assert status == 130
    assert launcher.events == [
        ("start", "alpha"),
        ("stop", "alpha"),
        ("start", "stopper"),
    ]  # beta never starts
    assert [(d["label"], d["stage"]) for d in doc["deployments"]] == [
        ("alpha", "done"),
        ("stopper", "interrupted"),
    ]
    assert (tmp_path / "out" / "alpha.json").is_file()


def test_labels_name_the_deployments_and_must_match_the_configs(launcher, tmp_path, capsys):
    status, doc = run_compare(tmp_path, "alpha", "beta", extra=("--label", "A", "--label", "B"))
    assert status == 0 and [d["label"] for d in doc["deployments"]] == ["A", "B"]
    assert (tmp_path / "out" / "A.json").is_file()

    config = write_config(tmp_path, "alpha")
    status = main(["bench", "compare", "--config", config, "--label", "A", "--label", "B", "--output-dir", str(tmp_path / "x")])  # fmt: skip
    assert status == 2 and "2 --label for 1 --config" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_default_labels_are_the_file_stems_made_distinct():
    assert deployment_labels(["a/colocated.yaml", "b/colocated.yaml", "c/disagg.yml"], None) == [
        "colocated", "colocated-2", "disagg"
    ]  # fmt: skip
    assert deployment_labels(["x.yaml", "x.yaml", "x.yaml"], None) == ["x", "x-2", "x-3"]
    with pytest.raises(ValueError, match="distinct"):
        deployment_labels(["a.yaml", "b.yaml"], ["same", "same"])
