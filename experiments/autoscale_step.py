"""Experiment: a load step with the SLO autoscaler off and on, side by side.

    python -m experiments.autoscale_step [--rate 3] [--before-s 30] [--step-s 60] [--after-s 60]
        [--max-tokens 32] [--slots 1] [--modes off,on] [--seed 0]

For each mode, starts a real deployment on local Ray (the tiny model; one prefill replica; a
decode pool whose replicas hold `--slots` requests each (1), so one replica's room, not the CPU,
is what a doubled rate overflows) and sends an open-loop Poisson load through the gateway:
`--rate` requests/s for `--before-s`, twice that for `--step-s`, then `--rate` again for
`--after-s`. `off`: one decode replica throughout. `on`: the decode pool autoscaled 1..2 with
short timings (`AUTOSCALE` below), so it adds a replica during the step and drains it after.
Printed per mode, over all requests of the run: completed and failed, goodput (requests/s that
met TTFT <= `--slo-ttft-ms` and TPOT <= `--slo-tpot-ms`), TTFT and ITL p50/p99, and over the
step and the minute after it the same TTFT p99; the decode replicas over time (when the pool
went up and came down, seconds from the step's start).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx
import ray

from bench.api import endpoint_url, streaming_body
from bench.arrivals import arrival_offsets
from bench.client import stream_request
from bench.metrics import LatencyStats, Summary, summarize
from bench.records import RequestRecord
from deploy.launcher import ClusterHandle, run_cluster
from splitserve.config import ClusterConfig, parse_config
from splitserve.tiny_model import make_tiny_model

MODEL = "tiny"
AUTOSCALE = {
    "min_replicas": 1,
    "max_replicas": 2,
    "interval_s": 1,
    "scale_up_after_s": 3,
    "scale_down_after_s": 15,
    "cooldown_s": 5,
}


@dataclass(frozen=True)
class Run:
    mode: str
    summary: Summary
    step_ttft: LatencyStats  # requests sent during the step and the `--after-s` after it
    replicas: list[tuple[float, int]]  # (seconds from the step's start, decode replicas) at each change


def cluster_config(model_path: str, slots: int, autoscale: bool) -> ClusterConfig:
    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB"}
    decode: dict[str, Any] = {**pool, "max_num_seqs": slots}
    if autoscale:
        decode |= {"autoscale": AUTOSCALE, "slo": {"itl_ms": 200}}
    return parse_config(
        {
            "model": {"path": model_path, "name": MODEL},
            "gateway": {"port": 0, "max_queued_requests": 100000},
            "prefill": pool,
            "decode": decode,
            "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
            "cache": {"enable_prefix_caching": False},
            "health": {"interval_s": 2, "timeout_s": 30, "start_timeout_s": 300, "drain_timeout_s": 120},
        }
    )


def schedule(args: argparse.Namespace) -> list[float]:
    """Send times from the run's start: the base rate, the doubled rate, the base rate again."""
    times: list[float] = []
    start_s = 0.0
    for number, (rate, length_s) in enumerate(
        [(args.rate, args.before_s), (2 * args.rate, args.step_s), (args.rate, args.after_s)]
    ):
        offsets = arrival_offsets(int(rate * length_s * 2) + 10, rate, seed=args.seed + number)
        times += [start_s + t for t in offsets if t < length_s]
        start_s += length_s
    return times


async def drive(
    url: str, times: list[float], prompts: list[list[int]], max_tokens: int
) -> list[RequestRecord]:
    """Each request sent at its time, whatever is in flight (open loop); every record."""
    target = endpoint_url(url, "completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start_s = time.perf_counter()

        async def one(index: int, at_s: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start_s + at_s - time.perf_counter()))
            prompt = prompts[index % len(prompts)]
            body = streaming_body("completions", MODEL, prompt, max_tokens, {"temperature": 0})
            stream = await stream_request(client, target, body, "completions")
            return RequestRecord.from_stream(
                stream,
                index=index,
                benchmark_start_s=start_s,
                prompt_tokens=len(prompt),
                max_tokens=max_tokens,
            )

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(times))))


def watch_replicas(cluster: ClusterHandle, step_at_s: float, stop: asyncio.Event) -> Any:
    """A task recording the decode pool's running replicas at each change."""

    async def run() -> list[tuple[float, int]]:
        seen: list[tuple[float, int]] = []
        while True:
            count = (await asyncio.to_thread(cluster.status))["pools"]["decode"]["replicas"]
            if not seen or seen[-1][1] != count:
                seen.append((round(time.perf_counter() - step_at_s, 1), count))
            if stop.is_set():
                return seen
            await asyncio.sleep(0.5)

    return run()


async def measure(
    cluster: ClusterHandle, args: argparse.Namespace, prompts: list[list[int]]
) -> tuple[Any, ...]:
    times = schedule(args)
    stop = asyncio.Event()
    step_at_s = time.perf_counter() + args.before_s
    watcher = asyncio.create_task(watch_replicas(cluster, step_at_s, stop))
    began_s = time.perf_counter()
    records = await drive(cluster.gateway_url or "", times, prompts, args.max_tokens)
    duration_s = time.perf_counter() - began_s
    if args.wait_down:  # the "on" pool drains after the step: wait for it, to show when
        deadline_s = time.perf_counter() + 120
        while cluster.status()["pools"]["decode"]["replicas"] > 1 and time.perf_counter() < deadline_s:
            await asyncio.sleep(0.5)
    stop.set()
    return records, duration_s, await watcher


def run_mode(mode: str, model_path: str, args: argparse.Namespace, prompts: list[list[int]]) -> Run:
    config = cluster_config(model_path, args.slots, autoscale=mode == "on")
    with run_cluster(config) as cluster:
        records, duration_s, replicas = asyncio.run(measure(cluster, args, prompts))
    slos = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    step = [r for r in records if args.before_s <= r.start_s < args.before_s + args.step_s + args.after_s]
    step_ttft = LatencyStats.of_seconds([r.ttft_s for r in step if r.ttft_s is not None])
    failures = collections.Counter(r.error[:300] for r in records if not r.success)
    for error, count in failures.items():
        print(f"{mode}: {count} failed: {error}")
    return Run(mode, summarize(records, duration_s, slos), step_ttft, replicas)


def report(runs: list[Run], args: argparse.Namespace) -> None:
    print(
        f"\nload step: {args.rate:g} req/s for {args.before_s:g} s, {2 * args.rate:g} req/s for "
        f"{args.step_s:g} s, {args.rate:g} req/s for {args.after_s:g} s; {args.max_tokens} tokens out, "
        f"{args.slots} slots per decode replica; goodput: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
        f"{args.slo_tpot_ms:g} ms"
    )
    rows = [
        ("autoscaling", lambda r: r.mode),
        ("requests completed / failed", lambda r: f"{r.summary.completed} / {r.summary.failed}"),
        ("goodput (req/s)", lambda r: f"{r.summary.goodput_rps:.2f}"),
        ("share within SLO", lambda r: f"{_share(r):.0%}"),
        ("TTFT p50 / p99 (ms)", lambda r: f"{r.summary.ttft.median_ms:.0f} / {r.summary.ttft.p99_ms:.0f}"),
        ("TTFT p99, step + after (ms)", lambda r: f"{r.step_ttft.p99_ms:.0f}"),
        ("ITL p50 / p99 (ms)", lambda r: f"{r.summary.itl.median_ms:.1f} / {r.summary.itl.p99_ms:.1f}"),
        ("TPOT p99 (ms)", lambda r: f"{r.summary.tpot.p99_ms:.1f}"),
        ("decode replicas (s from step start: n)", lambda r: ", ".join(f"{t:g}: {n}" for t, n in r.replicas)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, cell in rows:
        print(f"{name:<{width}}  " + "  ".join(f"{cell(r):>28}" for r in runs))


def _share(run: Run) -> float:
    total = run.summary.completed + run.summary.failed
    good = (run.summary.goodput_rps or 0.0) * run.summary.duration_s
    return good / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=3.0, help="base requests/s (doubled during the step)")
    parser.add_argument("--before-s", type=float, default=30.0)
    parser.add_argument("--step-s", type=float, default=60.0)
    parser.add_argument("--after-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slots", type=int, default=1, help="max_num_seqs of each decode replica")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--modes", default="off,on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-wait-down", dest="wait_down", action="store_false")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(16, 64))] for _ in range(64)]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as folder:
            model_path = str(make_tiny_model(folder, seed=3))
            runs = [run_mode(mode, model_path, args, prompts) for mode in args.modes.split(",")]
        report(runs, args)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
