"""Benchmark: disaggregated against colocated, same workload, same worker count, one run.

    python -m splitserve.benchmarks.disaggregation [--num-requests 48] [--concurrency 16]

Brings each mode up in turn with `run_cluster` (local Ray: 1 prefill + 1 decode worker, or 2
colocated workers), streams a mixed workload through the OpenAI API (prompts 16-512 tokens,
outputs 16-64), and prints TTFT and inter-token latency p50/p99, output tokens/s, the handoff
gap (the client's wait from the prefill's first token to the decode worker's first one) and,
from the gateway's own metrics, the state transfer seconds per request (the prefill's put that
was not overlapped plus the decode's wait for the last layer).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _one(base: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT s, inter-token gaps s, output tokens) of one streaming completion."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"text":""' not in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, len(stamps)


def _transfer_seconds(base: str) -> tuple[float, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    total = count = 0.0
    for line in text.splitlines():
        if "transfer" in line and "seconds" in line and not line.startswith("#"):
            if "_sum" in line:
                total += float(line.rsplit(" ", 1)[1])
            elif "_count" in line:
                count += float(line.rsplit(" ", 1)[1])
    return total, count


def run_mode(model: Path, mode: str, prompts: list[list[int]], outputs: list[int], concurrency: int) -> None:
    from deploy.launcher import run_cluster
    from splitserve.config import parse_config

    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": "64MiB"}
    data = {
        "model": {"path": str(model), "name": "tiny"},
        "mode": mode,
        "gateway": {"port": 0},
        "prefill": {**pool, "replicas": 1 if mode == "disaggregated" else 2},
        "decode": pool if mode == "disaggregated" else {"replicas": 0},
        "store": {"memory_bytes": "256MiB", "disk": {"path": None}},
    }
    with run_cluster(parse_config(data)) as cluster:
        base = cluster.gateway_url
        assert base is not None
        _one(base, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool_:
            results = list(pool_.map(lambda a: _one(base, *a), zip(prompts, outputs)))
        elapsed = time.perf_counter() - start
        transfer_s, transfers = _transfer_seconds(base)
    ttft = [r[0] for r in results]
    handoff = [r[1][0] for r in results if r[1]]  # first token (prefill) -> second (decode's first step)
    itl = [g for r in results for g in r[1][1:]]
    tokens = sum(r[2] for r in results)
    print(
        f"{mode:14s} TTFT p50 {1e3 * statistics.median(ttft):7.1f} ms  p99 {1e3 * _percentile(ttft, 99):7.1f} ms | "
        f"ITL p50 {1e3 * statistics.median(itl):6.1f} ms  p99 {1e3 * _percentile(itl, 99):7.1f} ms | "
        f"{tokens / elapsed:6.1f} out tok/s | handoff gap p50 {1e3 * statistics.median(handoff):6.1f} ms | "
        f"state transfer {1e3 * transfer_s / max(transfers, 1):6.1f} ms/request"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from splitserve.tiny_model import make_tiny_model

    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, 2000) for _ in range(rng.randint(16, 512))] for _ in range(args.num_requests)
    ]
    outputs = [rng.randint(16, 64) for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", seed=args.seed)
        print(
            f"{args.num_requests} requests, concurrency {args.concurrency}, "
            f"{sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens"
        )
        for mode in ("colocated", "disaggregated"):
            run_mode(model, mode, prompts, outputs, args.concurrency)


if __name__ == "__main__":
    main()
