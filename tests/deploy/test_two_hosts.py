"""A real two-host run: two network namespaces on this machine as two hosts on one link (head
10.77.0.1, worker 10.77.0.2; tests/netns.py), a Ray head on one and a Ray worker node on the
other started with `ray start` and a shared token file, and `splitserve up --address` run on the
head host as an operator would. The prefill pool is pinned to the head by `resources:`
(`prefill_host`, which only the head has), the decode pool to hosts with `decode_host`: both
have one, but the head's is held by another job while the deployment starts, so decode lands
on the worker host, and is given back before the loss. Every worker and store listens on its
host's own address, so a prompt's state crosses the link: written into the head's store by the
prefill, read from there by the decode worker on the other host (gRPC bytes; with
`store.transfer_engine: mooncake`, where its wheel imports, Mooncake's TCP transport).

Then the worker host is lost (every process in its namespace SIGKILLed: the raylet, the decode
worker, its store) under a closed-loop load: Ray marks the node dead, re-places the decode
bundle on the head, the controller starts the decode worker there beside the head's store and
drops the lost host's store, and every request, those in flight at the loss included (their
streams fail over and wait for the new decode worker), completes with the offline engine's
tokens.

The test process stays outside both namespaces: it reaches the gateway through a Unix socket
relayed inside the head host (tests/uds_relay.py) and asks `splitserve status --json` there.
Skipped where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from deploy.placement import HEAD_NODE_RESOURCE
from splitserve import LLM, SamplingParams
from splitserve.tiny_model import make_tiny_model
from tests.deploy.helpers import wait_until
from tests.deploy.ray_hosts import RoomHolder, cluster_env, join, start_head
from tests.deploy.splitserve_process import UpProcess
from tests.deploy.test_multinode_real import PARAMS, PROMPTS  # the same requests as on two raylets
from tests.e2e.helpers import MODEL, complete
from tests.faults.load import ClosedLoopLoad, num_ok_since, summary
from tests.netns import Host, missing_privilege, two_hosts
from tests.state_store.test_mooncake_transport import _mooncake_missing

pytestmark = pytest.mark.skipif(
    (why := missing_privilege()) is not None, reason=f"two hosts on this machine: {why}"
)

NAME = "twohost"
HEAD_RESOURCES = {"prefill_host": 1.0, "decode_host": 1.0}
WORKER_RESOURCES = {"decode_host": 1.0}
WORKER = {"num_cpus": 1, "kv_cache_memory_bytes": "16MiB", "max_num_seqs": 8}
# head: prefill 1 + store 0.25 + gateway 0.25, and the decode worker's 1 after the loss
HEAD_CPUS, WORKER_CPUS = 3, 2
LOAD_MAX_TOKENS = 24
UP_TIMEOUT_S = 600  # model load on a busy machine
RECOVERY_TIMEOUT_S = 300


@dataclass
class TwoHostDeployment:
    """What the tests use: the hosts, the environment of the cluster's drivers, the gateway's relay."""

    head: Host
    worker: Host
    env: dict[str, str]
    uds: str
    transfer_engine: str  # store.transfer_engine

    def status(self) -> dict[str, Any]:
        """`splitserve status --json` run on the head host (it exits 1 while something is down)."""
        argv = self.head.command(sys.executable, "-m", "cli.main", "status", "--name", NAME, "--json")
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=120, check=False)
        assert done.stdout.startswith("{"), f"status failed ({done.returncode}): {done.stderr[-3000:]}"
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def client(self) -> openai.OpenAI:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), timeout=120)
        return openai.OpenAI(base_url="http://gateway/v1", api_key="unused", max_retries=0, http_client=http)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("two-hosts-model"), seed=9)


@pytest.fixture(scope="module", params=["none", "mooncake"])
def deployment(request: pytest.FixtureRequest, model_path: Path) -> Iterator[TwoHostDeployment]:
    engine = request.param
    if engine == "mooncake" and (missing := _mooncake_missing()) is not None:
        pytest.skip(f"mooncake unusable: {missing}")
    work = Path(tempfile.mkdtemp(prefix="ss2h-", dir="/tmp"))  # short: Ray's socket paths live under it
    config = work / "cluster.yaml"
    config.write_text(yaml.safe_dump(_config(model_path, engine)), encoding="utf-8")
    env = cluster_env(work)
    try:
        with two_hosts() as (head, worker):
            address = start_head(head, env, work / "ray-head", HEAD_CPUS, HEAD_RESOURCES)
            join(worker, address, env, work / "ray-worker", WORKER_CPUS, WORKER_RESOURCES)
            # the head's decode room is another job's while the deployment places its pools
            holder = RoomHolder(head, address, env, {"decode_host": 1.0, HEAD_NODE_RESOURCE: 0.001})
            up = UpProcess(
                config, work / "runtime", NAME, prefix=head.command(), args=["--address", address], env=env
            )
            relay: subprocess.Popen[str] | None = None
            try:
                up.wait_for_line("healthy:", UP_TIMEOUT_S)
                holder.release()
                gateway_url = json.loads((work / "runtime" / f"{NAME}.json").read_text())["gateway_url"]
                port = gateway_url.rsplit(":", 1)[1]
                uds = str(work / "gateway.sock")
                relay = subprocess.Popen(
                    head.command(sys.executable, "-m", "tests.uds_relay", uds, "127.0.0.1", port),
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert relay.stdout is not None and relay.stdout.readline().strip() == "ready"
                runtime = {**env, "SPLITSERVE_RUNTIME_DIR": str(work / "runtime")}
                yield TwoHostDeployment(head, worker, runtime, uds, engine)
            finally:
                up.stop()
                holder.kill()
                if relay is not None:
                    relay.kill()
                    relay.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _config(model_path: Path, engine: str) -> dict[str, Any]:
    return {
        "model": {"path": str(model_path), "name": MODEL},
        "gateway": {"port": 0},
        "prefill": {**WORKER, "resources": {"prefill_host": 1}},
        # the streams of the lost decode worker wait for its restart on the head
        "decode": {**WORKER, "resources": {"decode_host": 1}, "failover_wait_s": RECOVERY_TIMEOUT_S},
        "store": {"memory_bytes": "64MiB", "disk": {"path": None}, "transfer_engine": engine},
        "health": {"interval_s": 1, "timeout_s": 10, "start_timeout_s": 300},
    }


@pytest.fixture(scope="module")
def offline(model_path: Path) -> dict[tuple[int, ...], list[int]]:
    """The offline engine's tokens for the load's prompts (greedy, LOAD_MAX_TOKENS each)."""
    llm = LLM(model=str(model_path), kv_cache_memory_bytes=16 * 2**20, max_num_seqs=8)
    params = SamplingParams(max_tokens=LOAD_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    return {tuple(p): list(out.outputs[0].token_ids) for p, out in zip(PROMPTS, outputs)}


def _workers(status: dict[str, Any], pool: str) -> list[dict[str, Any]]:
    return status["pools"][pool]["workers"]  # type: ignore[no-any-return]


def _store_on(status: dict[str, Any], ip: str) -> dict[str, Any]:
    (row,) = [store for store in status["stores"] if store["node_ip"] == ip]
    return row  # type: ignore[no-any-return]


def test_prefill_runs_on_the_head_host_and_decode_on_the_worker_host(deployment: TwoHostDeployment) -> None:
    status = deployment.status()
    head, worker = deployment.head.ip, deployment.worker.ip
    assert status["healthy"], status
    (prefill,) = _workers(status, "prefill")
    (decode,) = _workers(status, "decode")
    assert prefill["node_ip"] == head and prefill["address"].startswith(f"{head}:")
    assert decode["node_ip"] == worker and decode["address"].startswith(f"{worker}:")
    assert status["gateway"]["node_ip"] == head
    assert sorted(store["node_ip"] for store in status["stores"]) == [head, worker]
    assert all(store["address"].startswith(f"{store['node_ip']}:") for store in status["stores"])


def test_tokens_equal_the_offline_engine_and_the_state_crossed_to_the_worker_host(
    deployment: TwoHostDeployment, model_path: Path
) -> None:
    head, worker = deployment.head.ip, deployment.worker.ip
    before = deployment.status()
    releases = {ip: _store_on(before, ip)["stats"].get("num_releases", 0) for ip in (head, worker)}
    client = deployment.client()
    tokens = [complete(client, prompt, params) for prompt, params in zip(PROMPTS, PARAMS)]
    llm = LLM(model=str(model_path), kv_cache_memory_bytes=16 * 2**20, max_num_seqs=8)
    sampling = [SamplingParams(ignore_eos=True, **p) for p in PARAMS]
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sampling)
    assert tokens == [list(out.outputs[0].token_ids) for out in outputs]
    num_handoffs = sum(p["max_tokens"] > 1 for p in PARAMS)

    def read_from_the_head() -> dict[str, Any] | None:  # stats are as of the last health pass
        status = deployment.status()
        done = _store_on(status, head)["stats"].get("num_releases", 0) >= releases[head] + num_handoffs
        seen = _workers(status, "decode")[0]["stats"].get("cross_node_transport")
        return status if done and seen else None

    after = wait_until(
        read_from_the_head, timeout_s=60, what="the head's store to free the handed-off states"
    )
    # each state was read once, from the prefill's store on the head, by the decode worker across the link
    assert _store_on(after, head)["stats"]["num_releases"] == releases[head] + num_handoffs
    assert _store_on(after, worker)["stats"].get("num_releases", 0) == releases[worker]
    # and as gRPC bytes, or pulled through the stores' transfer engine
    expected = "grpc" if deployment.transfer_engine == "none" else deployment.transfer_engine
    assert _workers(after, "decode")[0]["stats"]["cross_node_transport"] == expected


def test_losing_the_worker_host_brings_decode_back_on_the_head_and_every_request_completes(
    deployment: TwoHostDeployment, offline: dict[tuple[int, ...], list[int]]
) -> None:
    head, worker = deployment.head.ip, deployment.worker.ip

    def body(client: int, n: int) -> dict[str, Any]:
        prompt = PROMPTS[(client + n) % len(PROMPTS)]
        return {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": LOAD_MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        }

    load = ClosedLoopLoad(
        "http://gateway", body, num_clients=3, timeout_s=2 * RECOVERY_TIMEOUT_S, uds=deployment.uds
    )
    try:
        load.wait_for(lambda outcomes: sum(o.ok for o in outcomes) >= 3, "requests served before the loss")
        lost_at_s = time.monotonic()
        killed = deployment.worker.kill_everything()
        assert killed, "nothing ran on the worker host"

        def decode_on_the_head() -> dict[str, Any] | None:
            status = deployment.status()
            (decode,) = _workers(status, "decode")
            return status if decode["healthy"] and decode["node_ip"] == head and status["healthy"] else None

        status = wait_until(decode_on_the_head, timeout_s=RECOVERY_TIMEOUT_S, what="decode back on the head")
        back_at_s = time.monotonic()
        load.wait_for(lambda outcomes: num_ok_since(outcomes, back_at_s) >= 3, "requests served after it")
    finally:
        outcomes = load.stop()
    in_flight = [o for o in outcomes if o.started_s < lost_at_s < o.ended_s]
    print(
        f"\nworker host lost: {len(killed)} processes SIGKILLed; decode healthy on the head "
        f"{back_at_s - lost_at_s:.1f} s later; {len(outcomes)} requests, {len(in_flight)} in flight "
        f"at the loss: {summary(outcomes)}"
    )
    assert in_flight, "no request was in flight at the loss"
    assert all(o.ok for o in outcomes), summary(outcomes)
    for outcome in outcomes:
        assert outcome.token_ids == offline[tuple(outcome.prompt)], outcome  # type: ignore[arg-type]
    (decode,) = _workers(status, "decode")
    assert decode["restarts"] >= 1 and decode["address"].startswith(f"{head}:")
    (prefill,) = _workers(status, "prefill")
    assert prefill["restarts"] == 0 and prefill["node_ip"] == head
    # the worker host's store went with it; the head's serves the decode worker now
    assert [store["node_ip"] for store in status["stores"]] == [head]
    assert status["healthy"], status
    assert worker not in json.dumps(status["published"])
