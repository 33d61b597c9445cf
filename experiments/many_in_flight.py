"""Experiment: N streaming requests in flight at once against one local deployment.

    python -m experiments.many_in_flight [--in-flight 100,250,500] [--config FILE]
        [--prompt-tokens 64-256] [--max-tokens 8-16] [--name h17inf]

Starts a deployment on its own local Ray (`run_cluster`, the default config unless `--config`:
the embedded tiny model, one prefill and one decode worker, default `max_num_seqs` and admission
queue; the gateway on a free port), then for each N opens N greedy streaming completions at once
(httpx, one connection each; prompts of random token ids, EOS ignored so every stream should
bring exactly its max_tokens; `--leave-after-s` drops those still running then). Per round it
prints: completed / failed (by HTTP status, stream error or exception, with the first error
texts), TTFT and end-to-end p50/p99 at the client, the
admission queue (peak depth, refusals), and per process of the deployment (gateway, store,
workers) its thread count, open fds and RSS before, at peak (sampled from /proc every 0.25 s)
and after; then whether the deployment went back to idle: no request, reservation or slot held
by a worker, no request key in a store, threads and fds back to where they were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
import ray

from deploy.launcher import ClusterHandle, run_cluster
from splitserve.config import ClusterConfig, default_config, load_config
from splitserve.rpc import make_channel
from splitserve.v1 import store_pb2, store_pb2_grpc

SAMPLE_INTERVAL_S = 0.25
IDLE_TIMEOUT_S = 60.0
WORKER_BUSY_KEYS = ("num_running", "num_waiting", "num_reserved")


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int  # HTTP status (0: no response)
    error: str = ""  # non-empty: it failed (status text, stream error event, exception)
    ttft_s: float = float("nan")  # sent -> first token
    e2e_s: float = float("nan")  # sent -> stream end
    num_tokens: int = 0


@dataclass
class ProcessFigures:
    """Threads, open fds and RSS of one process: before a round, the most during it, after it."""

    name: str
    pid: int
    before: tuple[int, int, int] = (0, 0, 0)
    peak: tuple[int, int, int] = (0, 0, 0)
    after: tuple[int, int, int] = (0, 0, 0)


def read_proc(pid: int) -> tuple[int, int, int]:
    """(threads, open fds, RSS bytes) of process `pid` from /proc; zeros once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        num_fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0, 0, 0
    return int(fields["Threads"]), num_fds, int(fields["VmRSS"].split()[0]) * 1024


def deployment_processes(handle: ClusterHandle) -> list[ProcessFigures]:
    status = handle.status()
    rows = [("gateway", status["gateway"])]
    rows += [(f"store {i}", row) for i, row in enumerate(status["stores"])]
    rows += [
        (f"{name} {row['index']}", row) for name, pool in status["pools"].items() for row in pool["workers"]
    ]
    return [ProcessFigures(name, row["pid"]) for name, row in rows if row and row.get("pid")]


@dataclass
class Sampler:
    """Samples /proc of every process and the gateway's queue depth in a thread while a round runs."""

    processes: list[ProcessFigures]
    metrics_url: str
    peak_queue_depth: float = 0.0
    peak_slots_in_use: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Sampler:
        for p in self.processes:
            p.before = p.peak = read_proc(p.pid)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last_metrics_s = 0.0
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            for p in self.processes:
                p.peak = tuple(max(a, b) for a, b in zip(p.peak, read_proc(p.pid)))  # type: ignore[assignment]
            if time.monotonic() - last_metrics_s >= 1.0:  # the gateway is busy: ask it once a second
                last_metrics_s = time.monotonic()
                depth = gateway_metric(self.metrics_url, "splitserve_admission_queue_depth")
                self.peak_queue_depth = max(self.peak_queue_depth, sum(depth.values()))
                in_use = gateway_metric(self.metrics_url, "splitserve_admission_slots_in_use")
                self.peak_slots_in_use = max(self.peak_slots_in_use, sum(in_use.values()))


def gateway_metric(metrics_url: str, name: str) -> dict[str, float]:
    """Every sample of metric `name` on the gateway's /metrics, by its label text ({} if none)."""
    try:
        text = httpx.get(metrics_url, timeout=5).text
    except httpx.HTTPError:
        return {}
    samples = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            labels, _, value = line[len(name) :].rpartition(" ")
            samples[labels] = float(value)
    return samples


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    sent_s = time.monotonic()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Outcome(response.status_code, f"{response.status_code}: {text[:300]}")
            outcome = Outcome(200)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    break
                logprobs = event["choices"][0].get("logprobs") or {}
                new = len(logprobs.get("tokens") or [])
                if new and outcome.num_tokens == 0:
                    outcome.ttft_s = time.monotonic() - sent_s
                outcome.num_tokens += new
    except Exception as exc:  # a dropped connection, a client timeout: counted, not raised
        return Outcome(0, f"{type(exc).__name__}: {exc}"[:300])
    outcome.e2e_s = time.monotonic() - sent_s
    if not outcome.error and outcome.num_tokens != body["max_tokens"]:
        outcome.error = f"short stream: {outcome.num_tokens} of {body['max_tokens']} tokens"
    return outcome


def make_bodies(model: str, n: int, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    low, high = (int(x) for x in args.prompt_tokens.split("-"))
    min_tokens, max_tokens = (int(x) for x in args.max_tokens.split("-"))
    return [
        {
            "model": model,
            "prompt": [rng.randrange(3, 2000) for _ in range(rng.randint(low, high))],
            "max_tokens": rng.randint(min_tokens, max_tokens),
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "stream": True,
        }
        for _ in range(n)
    ]


async def run_round(
    gateway_url: str, bodies: list[dict[str, Any]], timeout_s: float, leave_after_s: float | None = None
) -> list[Outcome]:
    """Every request at once; with `leave_after_s`, the client walks away from each one still
    running then (closes its connection), as a crowd of impatient clients would."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        url = f"{gateway_url}/v1/completions"
        if leave_after_s is None:
            return await asyncio.gather(*(one_request(client, url, b) for b in bodies))
        return await asyncio.gather(
            *(_left_after(one_request(client, url, b), leave_after_s) for b in bodies)
        )


async def _left_after(request: Coroutine[Any, Any, Outcome], leave_after_s: float) -> Outcome:
    try:
        return await asyncio.wait_for(request, leave_after_s)
    except asyncio.TimeoutError:
        return Outcome(0, f"left by the client after {leave_after_s:g} s")


def held_by_deployment(handle: ClusterHandle) -> dict[str, Any]:
    """What each worker and store still holds (only the non-zero counts); {} when idle."""
    status = handle.status()
    held: dict[str, Any] = {}
    for name, pool in status["pools"].items():
        for row in pool["workers"]:
            worker = ray.get(handle.controller.worker_handle.remote(name, row["index"]), timeout=30)
            stats = ray.get(worker.stats.remote(), timeout=30)
            busy = {k: stats[k] for k in WORKER_BUSY_KEYS if stats.get(k)}
            if stats["num_free_state_slots"] != stats["num_total_state_slots"]:
                busy["state_slots_in_use"] = stats["num_total_state_slots"] - stats["num_free_state_slots"]
            if busy:
                held[f"{name} {row['index']}"] = busy
    for i, store in enumerate(status["stores"]):
        with make_channel(store["address"]) as channel:
            stats = store_pb2_grpc.StateStoreStub(channel).Stats(store_pb2.StatsRequest(), timeout=30)
        if stats.num_keys - stats.num_prefix_keys:
            held[f"store {i}"] = {"request_keys": stats.num_keys - stats.num_prefix_keys}
    return held


def decode_room(handle: ClusterHandle) -> list[str]:
    """Each decode worker's KV blocks and state slots, as its stats() says."""
    room = []
    for row in handle.status()["pools"].get("decode", {}).get("workers", []):
        worker = ray.get(handle.controller.worker_handle.remote("decode", row["index"]), timeout=30)
        stats = ray.get(worker.stats.remote(), timeout=30)
        room.append(f"{stats['num_total_kv_blocks']} KV blocks, {stats['num_total_state_slots']} slots")
    return room


def store_retained(handle: ClusterHandle) -> str:
    """Each store's retained prefixes (kept on purpose: the cluster's prefix cache) and bytes."""
    parts = []
    for i, store in enumerate(handle.status()["stores"]):
        with make_channel(store["address"]) as channel:
            stats = store_pb2_grpc.StateStoreStub(channel).Stats(store_pb2.StatsRequest(), timeout=30)
        num_bytes = sum(tier.num_bytes for tier in stats.tiers)
        parts.append(
            f"store {i}: {stats.num_prefix_keys} prefix keys ({stats.num_prefix_bytes / 2**20:,.0f} MiB) "
            f"of {stats.num_keys} keys, {num_bytes / 2**20:,.0f} MiB in all"
        )
    return "; ".join(parts)


def settle(handle: ClusterHandle, processes: list[ProcessFigures]) -> tuple[dict[str, Any], float]:
    """Wait until no worker or store holds anything (up to IDLE_TIMEOUT_S), then read every
    process's figures; returns what is still held and the wait. Threads are reported, not
    waited for: gRPC's thread pools keep the threads they grew (bounded by max_workers)."""
    start_s = time.monotonic()
    while (held := held_by_deployment(handle)) and time.monotonic() - start_s < IDLE_TIMEOUT_S:
        time.sleep(0.5)
    waited_s = time.monotonic() - start_s
    for p in processes:
        p.after = read_proc(p.pid)
    return held, waited_s


def wait_for_capacity(metrics_url: str, timeout_s: float = 60.0) -> float:
    """Seconds until the gateway's admission queue knows the decode pool's capacity."""
    start_s = time.monotonic()
    while not sum(gateway_metric(metrics_url, "splitserve_admission_slots_capacity").values()):
        if time.monotonic() - start_s > timeout_s:
            raise RuntimeError(f"the gateway did not learn the decode pool's capacity in {timeout_s:g} s")
        time.sleep(0.1)
    return time.monotonic() - start_s


def percentiles_ms(values: list[float]) -> str:
    values = sorted(v for v in values if v == v)
    if not values:
        return "-"
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return f"p50 {statistics.median(values) * 1e3:,.0f} ms, p99 {p99 * 1e3:,.0f} ms"


def report_round(
    n: int, outcomes: list[Outcome], wall_s: float, sampler: Sampler, refused: dict[str, float]
) -> None:
    ok = [o for o in outcomes if not o.error]
    failures = Counter(o.status for o in outcomes if o.error)
    print(f"\n== {n} in flight: {len(ok)}/{n} completed in {wall_s:.1f} s", flush=True)
    if failures:
        print(f"   failed by status (0: no response): {dict(failures)}")
        for text, count in Counter(o.error for o in outcomes if o.error).most_common(5):
            print(f"   {count} x {text}")
    print(
        f"   TTFT {percentiles_ms([o.ttft_s for o in ok])}; end to end {percentiles_ms([o.e2e_s for o in ok])}"
    )
    print(
        f"   admission queue: peak depth {sampler.peak_queue_depth:.0f}, peak slots in use "
        f"{sampler.peak_slots_in_use:.0f}; refusals this round {refused}"
    )
    print(
        "   process        threads (before/peak/after)   fds (before/peak/after)   RSS MiB (before/peak/after)"
    )
    for p in sampler.processes:
        (t0, f0, r0), (t1, f1, r1), (t2, f2, r2) = p.before, p.peak, p.after
        mib = 1 << 20
        print(
            f"   {p.name:12s}   {t0:5d} / {t1:5d} / {t2:5d}            {f0:5d} / {f1:5d} / {f2:5d}       "
            f"{r0 / mib:6.0f} / {r1 / mib:6.0f} / {r2 / mib:6.0f}"
        )


def refusals(metrics_url: str) -> dict[str, float]:
    return {
        labels.split('reason="', 1)[1].split('"', 1)[0]: value
        for labels, value in gateway_metric(metrics_url, "splitserve_admission_refusals_total").items()
    }


def cluster_config(path: str | None) -> ClusterConfig:
    config = load_config(path) if path else default_config()
    data = config.model_dump()
    data["gateway"]["port"] = 0
    data["store"]["disk"]["path"] = None
    return ClusterConfig.model_validate(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--in-flight", default="100,250,500", help="concurrent requests per round")
    parser.add_argument("--config", default=None, help="a cluster config file (default: the embedded one)")
    parser.add_argument("--prompt-tokens", default="64-256", help="prompt length range, tokens")
    parser.add_argument("--max-tokens", default="8-16", help="max_tokens range per request")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="client timeout per request")
    parser.add_argument(
        "--no-wait-capacity",
        action="store_true",
        help="start at once, before the gateway knows the decode room",
    )
    parser.add_argument(
        "--leave-after-s", type=float, default=None, help="the client drops every request still running then"
    )
    parser.add_argument("--name", default="h17inf", help="the deployment's name (its own Ray)")
    args = parser.parse_args()
    config = cluster_config(args.config)
    with run_cluster(config, name=args.name) as handle:
        url = handle.gateway_url
        assert url, "the deployment has no gateway"
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        if not args.no_wait_capacity:
            waited_s = wait_for_capacity(f"{url}/metrics")
            print(f"the gateway knew the decode pool's capacity {waited_s:.1f} s after the deployment was up")
        print(
            f"model {model}; decode max_num_seqs {config.decode.max_num_seqs} x {config.decode.replicas}, "
            f"gateway.max_queued_requests {config.gateway.max_queued_requests}; admission capacity "
            f"{gateway_metric(f'{url}/metrics', 'splitserve_admission_slots_capacity')}; decode room "
            f"{decode_room(handle)}"
        )
        for round_index, n in enumerate(int(x) for x in args.in_flight.split(",")):
            bodies = make_bodies(model, n, args, seed=round_index)
            refused_before = refusals(f"{url}/metrics")
            with Sampler(deployment_processes(handle), f"{url}/metrics") as sampler:
                start_s = time.monotonic()
                outcomes = asyncio.run(run_round(url, bodies, args.timeout_s, args.leave_after_s))
                wall_s = time.monotonic() - start_s
            refused = {k: v - refused_before.get(k, 0.0) for k, v in refusals(f"{url}/metrics").items()}
            held, waited_s = settle(handle, sampler.processes)
            report_round(n, outcomes, wall_s, sampler, {k: v for k, v in refused.items() if v})
            print(f"   idle again: {'yes' if not held else 'NO'} after {waited_s:.1f} s {held or ''}")
            print(f"   retained (the prefix cache): {store_retained(handle)}", flush=True)


if __name__ == "__main__":
    main()
