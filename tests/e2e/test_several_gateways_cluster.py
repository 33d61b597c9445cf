"""Two gateway processes on one port through the product: `gateway.replicas: 2` under `run_cluster`
on local Ray, real workers and the tiny model.

Each process answers on the shared port and on a port of its own (`own_address` in `status`), so
what one process served is read from its own `/metrics`. The kernel spreads new connections over
both; greedy tokens through either equal the offline engine's; the decode pool's slots and
`gateway.max_queued_requests` hold across both (the admission ledger); a gateway process killed
with SIGKILL is started again on the same port while the other keeps serving.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deploy.launcher import ClusterHandle, run_cluster
from splitserve import LLM, SamplingParams
from splitserve.tiny_model import make_tiny_model
from tests.deploy.helpers import wait_until
from tests.e2e.helpers import MODEL, TOKEN_IDS, cluster_config, token_id
from tests.faults.conftest import metric_value

NUM_PROMPTS = 6
NUM_TOKENS = 6
NUM_CONNECTIONS = 40  # new connections to the shared port: all on one process has odds 2 ** -39
MAX_QUEUED = 2
HOLD_TOKENS = 3000  # a holding stream runs this long unless cut (the tiny model's context is 4096)
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gateways-e2e-model"), seed=9)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(5, 90))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def offline(model_path, prompts) -> list[list[int]]:
    llm = LLM(model=str(model_path), max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def cluster(local_ray, model_path) -> Iterator[ClusterHandle]:
    gateway = {"port": 0, "replicas": 2, "max_queued_requests": MAX_QUEUED}
    with run_cluster(cluster_config(model_path, "disaggregated", max_num_seqs=2, gateway=gateway)) as handle:
        yield handle


def gateway_rows(cluster: ClusterHandle, *, restarts: int = 0) -> list[dict[str, Any]]:
    """Both gateways' status rows once each is healthy, has `restarts` at least for the second,
    and reports its own address; waits for it."""

    def ready() -> list[dict[str, Any]] | None:
        rows = cluster.status()["gateways"]
        if (
            all(r["healthy"] and r["stats"].get("own_address") for r in rows)
            and rows[1]["restarts"] >= restarts
        ):
            return rows  # type: ignore[no-any-return]
        return None

    return wait_until(ready, what="both gateway processes serving")


def own_urls(cluster: ClusterHandle, **kwargs: Any) -> list[str]:
    return [f"http://{row['stats']['own_address']}" for row in gateway_rows(cluster, **kwargs)]


def served(url: str) -> float:
    """Completions one gateway process answered 200, from its own /metrics."""
    return metric_value(url, "splitserve_http_responses_total", route=COMPLETIONS, status_code="200")


def greedy(url: str, prompt: list[int], max_tokens: int = NUM_TOKENS) -> httpx.Response:
    """One greedy completion on a new connection to `url`."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    return httpx.post(f"{url}{COMPLETIONS}", json={**body, **TOKEN_IDS}, timeout=120)


def completion_tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [token_id(t) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def test_both_processes_answer_on_the_one_port_with_the_offline_engines_tokens(cluster, prompts, offline):
    rows = gateway_rows(cluster)
    assert rows[0]["address"] == rows[1]["address"] and rows[0]["pid"] != rows[1]["pid"]
    urls = own_urls(cluster)
    for url in urls:
        assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    shared = cluster.gateway_url
    before = [served(url) for url in urls]
    for i in range(NUM_CONNECTIONS):  # a new connection each: the kernel picks a process each time
        index = i % NUM_PROMPTS
        assert completion_tokens(greedy(shared, prompts[index])) == offline[index], f"prompt {index}"
    counts = [served(url) - b for url, b in zip(urls, before, strict=True)]
    assert sum(counts) == NUM_CONNECTIONS and min(counts) > 0, counts


def report_seq(url: str, worker: str) -> float:
    """The last of `worker`'s prefix events this gateway process applied to its routing index."""
    return metric_value(url, "splitserve_prefix_report_seq", worker=worker)


def test_both_processes_route_by_every_prefix_event_of_the_prefill_worker(cluster):
    """Neither gateway drains the worker's events from the other: each reads after its own cursor."""
    urls = own_urls(cluster)
    (worker,) = cluster.status()["pools"]["prefill"]["addresses"]
    before = [report_seq(url, worker) for url in urls]
    prompt = [random.Random(8).randrange(3, 2000) for _ in range(200)]  # three whole prefix units
    assert greedy(urls[0], prompt, max_tokens=1).status_code == 200  # through the first process only

    def agreed() -> float | None:
        seqs = [report_seq(url, worker) for url in urls]
        return (
            seqs[0] if seqs[0] == seqs[1] and all(s > b for s, b in zip(seqs, before, strict=True)) else None
        )

    wait_until(agreed, what="both gateways to apply the worker's new prefix events")


class HoldingStream:
    """A streamed greedy completion of `HOLD_TOKENS` that keeps its decode slot until `cut()`."""

    def __init__(self, url: str, prompt: list[int]) -> None:
        self.first_token = threading.Event()
        self.cut_now = threading.Event()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": HOLD_TOKENS, "temperature": 0}
        self._thread = threading.Thread(target=self._run, args=(url, {**body, "ignore_eos": True}))
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        with httpx.stream(
            "POST", f"{url}{COMPLETIONS}", json={**body, "stream": True}, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.first_token.set()
                if self.cut_now.is_set():
                    return  # closing the connection aborts the generation and frees its slot

    def cut(self) -> None:
        self.cut_now.set()
        self._thread.join(timeout=120)


def ledger_stats(cluster: ClusterHandle) -> dict[str, Any]:
    return cluster.status()["ledger"]["stats"]  # type: ignore[no-any-return]


def test_the_decode_slots_and_the_queue_cap_hold_across_both_processes(cluster, prompts, offline):
    urls = own_urls(cluster)
    num_slots = wait_until(lambda: ledger_stats(cluster).get("capacity_slots"), what="the pool's slots")
    holders = [HoldingStream(urls[0], prompts[0]) for _ in range(num_slots)]
    queued: list[httpx.Response] = []
    try:
        for holder in holders:
            assert holder.first_token.wait(120), "a holding stream got no token"
        assert ledger_stats(cluster)["num_lent_slots"] == num_slots
        # one waits behind them through each process: the one queue is full
        waiting = [
            threading.Thread(target=lambda url=url, i=i: queued.append(greedy(url, prompts[i])))
            for i, url in enumerate(urls, start=1)
        ]
        for thread in waiting:
            thread.start()
        wait_until(lambda: ledger_stats(cluster)["num_waiting"] == MAX_QUEUED or None, what="two waiting")
        refusals_before = [
            metric_value(u, "splitserve_admission_refusals_total", reason="queue_full") for u in urls
        ]
        for url in [*urls, cluster.gateway_url]:  # past the cap, through either process: 429
            response = greedy(url, prompts[3])
            assert response.status_code == 429, response.text
            assert response.json()["error"]["type"] and response.headers["retry-after"]
        refusals = [metric_value(u, "splitserve_admission_refusals_total", reason="queue_full") for u in urls]
        assert all(after > before for after, before in zip(refusals, refusals_before, strict=True))
        assert not queued  # still waiting: nothing finished to free a slot
    finally:
        for holder in holders:
            holder.cut()
    for thread in waiting:
        thread.join(timeout=120)
    assert sorted(completion_tokens(r) for r in queued) == sorted([offline[1], offline[2]])


def test_a_gateway_killed_comes_back_on_the_port_while_the_other_serves(cluster, prompts, offline):
    rows = gateway_rows(cluster)
    os.kill(rows[1]["pid"], signal.SIGKILL)
    wait_until(lambda: not _alive(rows[1]["pid"]) or None, what="the killed gateway process to exit")
    first = f"http://{rows[0]['stats']['own_address']}"
    before = served(first)
    for i in range(NUM_PROMPTS):  # the shared port, every connection on the survivor
        assert completion_tokens(greedy(cluster.gateway_url, prompts[i])) == offline[i]
    assert served(first) - before == NUM_PROMPTS
    urls = own_urls(cluster, restarts=1)  # its own address as the new process reported it
    new = cluster.status()["gateways"][1]
    assert new["pid"] != rows[1]["pid"] and new["address"] == rows[1]["address"]
    assert httpx.get(f"{urls[1]}/health", timeout=30).json()["status"] == "ok"
    before_new = served(urls[1])
    for i in range(NUM_CONNECTIONS):
        assert (
            completion_tokens(greedy(cluster.gateway_url, prompts[i % NUM_PROMPTS]))
            == offline[i % NUM_PROMPTS]
        )
    assert served(urls[1]) > before_new  # the restarted process takes connections on the port again


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
