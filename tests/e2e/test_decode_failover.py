"""A decode worker SIGKILLed mid-stream: with decode.failover on, all 8 concurrent streams finish
with exactly the tokens of an uninterrupted run (greedy, then seeded) and the controller restores
the pool; with it off, the streams on the killed worker end with an SSE error event.

With `decode.replay_window: 16` the decode workers keep each request's state in the node's store
as they decode, and the streams of the killed worker resume from that stored state (the metric's
method says so), exactly; with the stored state gone (released before the kill), they fall back to
re-prefilling, still exactly.

The kill is keyed on tokens received (every stream has some, none has finished), never on a
sleep; the worker to kill is the decode worker running the most of them, its pid from the
controller's status.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from deploy.launcher import run_cluster
from splitserve import LLM, SamplingParams
from splitserve.config import parse_config
from splitserve.state.client import StateStoreClient
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import MODEL, complete, openai_client, token_id, worker_stats

NUM_STREAMS = 8
NUM_TOKENS = 96  # per stream; long enough that every stream is still running at the kill
NUM_BEFORE_KILL = 3  # tokens every stream must have received before the kill
NUM_BEFORE_KILL_STORED = 21  # past the first window: the stored state holds pieces by then
REPLAY_WINDOW = 16
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("failover-model"), seed=7)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(8, 160))] for _ in range(NUM_STREAMS)]


def _params(kind: dict[str, float], index: int) -> dict[str, Any]:
    seed = {"seed": 500 + index} if kind is SEEDED else {}
    return {"max_tokens": NUM_TOKENS, **kind, **seed}


@pytest.fixture(scope="module")
def expected(model_path, prompts) -> dict[str, list[list[int]]]:
    """The uninterrupted run's tokens (the offline engine, which the cluster equals unbroken)."""
    llm = LLM(model=str(model_path), max_model_len=4096)
    out = {}
    for name, kind in (("greedy", GREEDY), ("seeded", SEEDED)):
        sps = [SamplingParams(ignore_eos=True, **_params(kind, i)) for i in range(NUM_STREAMS)]
        results = llm.generate(prompt_token_ids=prompts, sampling_params=sps)
        out[name] = [r.outputs[0].token_ids for r in results]
    return out


def _config(model_path, failover: bool, replay_window: int = 0, caching: bool = False):
    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 16}
    return parse_config(
        {
            "model": {"path": str(model_path), "name": MODEL},
            "gateway": {"port": 0},
            "prefill": pool,
            "decode": {**pool, "replicas": 2, "failover": failover, "replay_window": replay_window},
            "store": {"memory_bytes": "128MiB", "disk": {"path": None}},
            # "failover" runs with the prefix cache on, as deployments do by default; the others
            # without, so every request is routed and prefilled afresh.
            "cache": {"enable_prefix_caching": caching},
            "router": {"policy": "least_load"},
            "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300, "max_restarts": 5},
        }
    )


@pytest.fixture(scope="module")
def cluster(request, local_ray, model_path):
    """A deployment as the test's indirect parameter says ("failover": with the prefix cache on,
    "no-failover", "stored": failover with ReplaySSM publishing); the tests of one value share it
    (pytest groups them), and it stops before the next value's starts."""
    mode = request.param
    replay_window = REPLAY_WINDOW if mode == "stored" else 0
    config = _config(model_path, mode != "no-failover", replay_window, caching=mode == "failover")
    with run_cluster(config) as handle:
        yield handle


FAILOVER_ON = pytest.mark.parametrize("cluster", ["failover"], indirect=True)
FAILOVER_OFF = pytest.mark.parametrize("cluster", ["no-failover"], indirect=True)
STORED = pytest.mark.parametrize("cluster", ["stored"], indirect=True)


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    token_ids: list[int] = field(default_factory=list)
    error: dict[str, Any] | None = None
    done: bool = False
    finish_reason: str | None = None


class Streams:
    """NUM_STREAMS concurrent streaming completions, each on its own thread, with a condition
    that wakes whoever waits on their progress."""

    def __init__(self, url: str, prompts: list[list[int]], kind: dict[str, float]) -> None:
        self.streams = [Stream() for _ in prompts]
        self._changed = threading.Condition()
        self._pool = ThreadPoolExecutor(len(prompts))
        self._futures = [
            self._pool.submit(self._run, url, i, prompt, _params(kind, i)) for i, prompt in enumerate(prompts)
        ]

    def _run(self, url: str, index: int, prompt: list[int], params: dict[str, Any]) -> None:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "stream": True,
            "logprobs": 0,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
            **params,
        }
        stream = self.streams[index]
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
                if response.status_code != 200:
                    stream.error = {"status": response.status_code, "body": response.read().decode()}
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    with self._changed:
                        self._take(stream, line[6:])
                        self._changed.notify_all()
        finally:
            with self._changed:
                stream.done = True
                self._changed.notify_all()

    @staticmethod
    def _take(stream: Stream, data: str) -> None:
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            stream.error = event["error"]
            return
        choice = event["choices"][0]
        if choice.get("logprobs"):
            stream.token_ids += [token_id(t) for t in choice["logprobs"]["tokens"]]
        stream.finish_reason = choice.get("finish_reason") or stream.finish_reason

    def wait_until_all_have(self, num_tokens: int, timeout_s: float = 300) -> None:
        """Until every stream has received `num_tokens` tokens; fails if one ended first."""
        with self._changed:
            reached = self._changed.wait_for(
                lambda: all(len(s.token_ids) >= num_tokens or s.done for s in self.streams), timeout_s
            )
            assert reached, f"streams did not reach {num_tokens} tokens: {self.streams}"
            ended = [i for i, s in enumerate(self.streams) if s.done]
            assert not ended, f"streams ended before the kill: {[self.streams[i] for i in ended]}"

    def finish(self) -> list[Stream]:
        for future in self._futures:
            future.result(timeout=300)
        self._pool.shutdown()
        return self.streams


def _decode_rows(handle) -> list[dict[str, Any]]:
    return handle.status()["pools"]["decode"]["workers"]


def _kill_busiest_decode_worker(handle, before_kill=None) -> dict[str, Any]:
    """SIGKILL the process of the decode worker running the most requests; its status row.
    `before_kill(handle, stats)` runs first with that worker's own stats."""
    rows = _decode_rows(handle)
    stats = [worker_stats(handle, "decode", row["index"]) for row in rows]
    running = [s["num_running"] for s in stats]
    row = rows[running.index(max(running))]
    assert max(running) > 0 and row["pid"], f"no decode worker is running anything: {rows}, {running}"
    if before_kill is not None:
        before_kill(handle, stats[running.index(max(running))])
    os.kill(row["pid"], signal.SIGKILL)
    return row


def _wait_restored(handle, killed: dict[str, Any], timeout_s: float = 300) -> None:
    """Until the controller has restarted the killed worker (a new pid, healthy) and both serve."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        rows = _decode_rows(handle)
        again = next(r for r in rows if r["index"] == killed["index"])
        if again["healthy"] and again["pid"] not in (None, killed["pid"]) and all(r["healthy"] for r in rows):
            assert again["restarts"] == killed["restarts"] + 1
            return
        assert time.monotonic() < deadline_s, f"the decode pool was not restored: {rows}"
        time.sleep(0.2)


def _failovers(url: str, outcome: str, method: str | None = None) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    prefix = "splitserve_decode_failovers_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(prefix)
        and f'outcome="{outcome}"' in line
        and (method is None or f'method="{method}"' in line)
    )


def _counts(url: str) -> dict[tuple[str, str], float]:
    return {
        (outcome, method): _failovers(url, outcome, method)
        for outcome in ("resumed", "failed")
        for method in ("stored_state", "reprefill")
    }


def _run_kill(handle, prompts, expected, kind: str, num_before_kill: int, before_kill=None) -> None:
    """8 streams, the busiest decode worker killed once each has `num_before_kill` tokens (after
    `before_kill(handle, its status row)`); every stream exact, the pool restored."""
    streams = Streams(handle.gateway_url, prompts, GREEDY if kind == "greedy" else SEEDED)
    streams.wait_until_all_have(num_before_kill)
    killed = _kill_busiest_decode_worker(handle, before_kill)
    results = streams.finish()
    errors = {i: s.error for i, s in enumerate(results) if s.error}
    assert not errors, f"streams ended with errors: {errors}"
    wrong = [i for i, (s, want) in enumerate(zip(results, expected[kind])) if s.token_ids != want]
    assert not wrong, f"streams {wrong} differ from the uninterrupted run"
    assert all(s.finish_reason == "length" for s in results)
    _wait_restored(handle, killed)


@FAILOVER_ON
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_every_stream_survives_a_killed_decode_worker_exactly(cluster, prompts, expected, kind):
    url = cluster.gateway_url
    resumed_before = _failovers(url, "resumed")
    _run_kill(cluster, prompts, expected, kind, NUM_BEFORE_KILL)
    assert _failovers(url, "resumed") > resumed_before  # the kill did land on running streams


@FAILOVER_ON
def test_failover_is_exact_where_the_prefix_cache_holds_part_of_the_reply(cluster, prompts, expected):
    """A client first continued each prompt from a few tokens of its reply (prompt + those tokens,
    sent as a new prompt): the prefill worker keeps that prompt's end as a prefix. Each failover's
    re-prefill of prompt + the tokens sent so far then starts from a hit that reaches past the
    prompt, into the sent tokens. The handoff must still carry every row from token 0: it once
    carried only the rows past the hit (the hit was counted as prompt tokens only), and every
    resumed stream failed with "state ... ended short ... tokens still missing per MLA layer"."""
    url = cluster.gateway_url
    client = openai_client(url)
    num_continued = NUM_BEFORE_KILL
    for prompt, want in zip(prompts, expected["greedy"]):
        continued = prompt + want[:num_continued]
        assert (
            complete(client, continued, {"max_tokens": 1, "temperature": 0})
            == want[num_continued : num_continued + 1]
        )
    resumed_before = _failovers(url, "resumed")
    _run_kill(cluster, prompts, expected, "greedy", num_continued + 4)
    assert _failovers(url, "resumed") > resumed_before


class SampleStreams:
    """One streamed completion of n samples, read on its own thread: each choice's tokens and
    finish as the client saw them, and a condition that wakes whoever waits on their progress."""

    def __init__(self, url: str, prompt: list[int], n: int, seed: int) -> None:
        self.tokens: dict[int, list[int]] = {i: [] for i in range(n)}
        self.finish_reasons: dict[int, str] = {}
        self.error: Any = None
        self.done = False
        self._changed = threading.Condition()
        body = {
            "model": MODEL,
            "prompt": prompt,
            "n": n,
            "seed": seed,
            "stream": True,
            "logprobs": 0,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
            "max_tokens": NUM_TOKENS,
            **SEEDED,
        }
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
                if response.status_code != 200:
                    self.error = {"status": response.status_code, "body": response.read().decode()}
                    return
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        with self._changed:
                            self._take(json.loads(line[6:]))
                            self._changed.notify_all()
        finally:
            with self._changed:
                self.done = True
                self._changed.notify_all()

    def _take(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.error = event["error"]
            return
        for choice in event["choices"]:
            index = choice["index"]
            assert index not in self.finish_reasons, f"choice {index} streamed after it finished"
            if choice.get("logprobs"):
                self.tokens[index] += [token_id(t) for t in choice["logprobs"]["tokens"]]
            if choice.get("finish_reason"):
                self.finish_reasons[index] = choice["finish_reason"]

    def wait_until_each_has(self, num_tokens: int, timeout_s: float = 300) -> None:
        with self._changed:
            reached = self._changed.wait_for(
                lambda: self.done or all(len(t) >= num_tokens for t in self.tokens.values()), timeout_s
            )
        assert reached and not self.done, f"the samples did not reach {num_tokens} tokens: {self.tokens}"

    def finish(self) -> None:
        self._thread.join(300)
        assert self.done


@FAILOVER_ON
def test_every_sample_of_a_request_survives_a_killed_decode_worker_exactly(cluster, prompts, model_path):
    """n = 3 seeded samples decode on one worker, forked from one prefill; that worker is
    SIGKILLed mid-stream: each sample resumes on its own (a re-prefill of prompt + its tokens,
    seeded seed + i), so each equals a separate request with its seed."""
    n, seed, prompt = 3, 700, prompts[1]
    llm = LLM(model=str(model_path), max_model_len=4096)
    alone = [
        SamplingParams(ignore_eos=True, max_tokens=NUM_TOKENS, seed=seed + i, **SEEDED) for i in range(n)
    ]
    expected = [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[prompt] * n, sampling_params=alone)
    ]
    url = cluster.gateway_url
    resumed_before = _failovers(url, "resumed", "reprefill")
    samples = SampleStreams(url, prompt, n, seed)
    samples.wait_until_each_has(NUM_BEFORE_KILL)
    killed = _kill_busiest_decode_worker(cluster)
    samples.finish()
    assert samples.error is None, samples.error
    assert [samples.tokens[i] for i in range(n)] == expected
    assert samples.finish_reasons == dict.fromkeys(range(n), "length")
    assert _failovers(url, "resumed", "reprefill") - resumed_before == n  # each sample on its own
    _wait_restored(cluster, killed)


@FAILOVER_OFF
def test_without_failover_the_killed_workers_streams_end_with_an_error_event(cluster, prompts, expected):
    handle = cluster
    streams = Streams(handle.gateway_url, prompts, GREEDY)
    streams.wait_until_all_have(NUM_BEFORE_KILL)
    killed = _kill_busiest_decode_worker(handle)
    results = streams.finish()

    failed = [i for i, s in enumerate(results) if s.error]
    assert failed, "no stream was on the killed worker"
    for i, stream in enumerate(results):
        want = expected["greedy"][i]
        if stream.error:
            assert stream.error["code"] == "decode_worker_lost", stream.error
            assert stream.error["type"] == "service_unavailable_error"
            assert "decode.failover is off" in stream.error["message"]
            assert stream.token_ids == want[: len(stream.token_ids)]  # what came before was right
        else:
            assert stream.token_ids == want
    _wait_restored(handle, killed)


@STORED
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_every_stream_resumes_from_stored_state_exactly(cluster, prompts, expected, kind):
    url = cluster.gateway_url
    before = _counts(url)
    _run_kill(cluster, prompts, expected, kind, NUM_BEFORE_KILL_STORED)
    after = _counts(url)
    assert after[("resumed", "stored_state")] > before[("resumed", "stored_state")], after
    assert after[("resumed", "reprefill")] == before[("resumed", "reprefill")], after
    assert after[("failed", "stored_state")] == before[("failed", "stored_state")], after


def _release_its_state(handle, stats: dict[str, Any]) -> None:
    """Everything the worker about to be killed keeps in the store goes, as if evicted."""
    assert stats.get("replay") is not None, f"the decode worker publishes nothing: {stats}"
    for store in handle.status()["stores"]:
        with StateStoreClient(store["address"], timeout_s=30) as client:
            client.release(owner=stats["worker_id"])


@STORED
def test_without_the_stored_state_the_streams_reprefill_exactly(cluster, prompts, expected):
    url = cluster.gateway_url
    before = _counts(url)
    _run_kill(cluster, prompts, expected, "greedy", NUM_BEFORE_KILL_STORED, _release_its_state)
    after = _counts(url)
    assert after[("failed", "stored_state")] > before[("failed", "stored_state")], after
    assert after[("resumed", "reprefill")] > before[("resumed", "reprefill")], after
