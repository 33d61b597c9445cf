"""Benchmark: disaggregated against colocated, same workload, same worker count, one run.

    python -m experiments.disaggregation [--num-prompts 64] [--request-rate 6]

Brings each mode up in turn with `run_cluster` (local Ray: 1 prefill + 1 decode worker, or 2
colocated workers) and drives it with `splitserve bench`'s runner: a seeded random workload of
mixed prompt lengths arriving as a Poisson stream, so long prompts keep arriving while others
decode. Prints, per mode: TTFT, TPOT and inter-token latency p50/p99, output tokens/s and
goodput at the stated SLO; the handoff gap (the client's wait between the first token, from
the prefill, and the second, from the decode worker's first step); and from the gateway's own
metrics the state each request handed over: bytes, the whole layer-by-layer stream (first
layer queued on the prefill to the store's ack) and the part of it nobody overlapped (the
prefill's put after its last layer plus the decode's wait for the state).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from bench.datasets import Dataset, DatasetConfig, build_dataset
from bench.result import BenchmarkResult
from bench.runner import RunConfig, run_benchmark

MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class StateMetrics:
    """Sums and counts of the gateway's state-handoff series, as scraped from /metrics."""

    sums: dict[str, float]

    @classmethod
    def scrape(cls, base_url: str) -> StateMetrics:
        sums: dict[str, float] = {}
        for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.startswith("splitserve_state_") and name.endswith(("_sum", "_count")):
                sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return cls(sums)

    def __sub__(self, earlier: StateMetrics) -> StateMetrics:
        return StateMetrics({k: v - earlier.sums.get(k, 0.0) for k, v in self.sums.items()})

    def mean(self, series: str) -> float:
        """Per-request mean of `series` (e.g. splitserve_state_transfer_bytes); 0 when none."""
        count = self.sums.get(f"{series}_count", 0.0)
        return self.sums.get(f"{series}_sum", 0.0) / count if count else 0.0

    @property
    def num_requests(self) -> int:
        return int(self.sums.get("splitserve_state_transfer_bytes_count", 0.0))


def _config(model: Path, mode: str, kv_bytes: str):  # type: ignore[no-untyped-def]
    from splitserve.config import parse_config

    pool = {"num_cpus": 0.5, "kv_cache_memory_bytes": kv_bytes}
    return parse_config(
        {
            "model": {"path": str(model), "name": "tiny"},
            "mode": mode,
            "gateway": {"port": 0},
            "prefill": {**pool, "replicas": 1 if mode == "disaggregated" else 2},
            "decode": pool if mode == "disaggregated" else {"replicas": 0},
            "store": {"memory_bytes": "512MiB", "disk": {"path": None}},
        }
    )


def run_mode(
    model: Path, mode: str, dataset: Dataset, run: RunConfig, kv_bytes: str
) -> tuple[BenchmarkResult, StateMetrics]:
    from deploy.launcher import run_cluster

    with run_cluster(_config(model, mode, kv_bytes)) as cluster:
        base = cluster.gateway_url
        assert base is not None
        warm_up = build_dataset(DatasetConfig(num_prompts=2, random_input_len=64, random_output_len=4), None)
        asyncio.run(run_benchmark(warm_up, RunConfig(base, run.model, disable_tqdm=True)))
        before = StateMetrics.scrape(base)
        result = asyncio.run(run_benchmark(dataset, dataclasses.replace(run, base_url=base)))
        state = StateMetrics.scrape(base) - before
    return result, state


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else math.nan


def report(mode: str, result: BenchmarkResult, state: StateMetrics) -> str:
    s = result.summary
    handoff = [r.itl_s[0] for r in result.records if r.success and r.itl_s]
    goodput = "n/a" if s.goodput_rps is None else f"{s.goodput_rps:.2f} req/s"
    lines = [
        f"{mode}: {s.completed} completed, {s.failed} failed in {s.duration_s:.1f} s",
        f"  TTFT p50 {s.ttft.median_ms:7.1f} ms  p99 {s.ttft.p99_ms:7.1f} ms | "
        f"TPOT p50 {s.tpot.median_ms:6.1f} ms  p99 {s.tpot.p99_ms:6.1f} ms | "
        f"ITL p50 {s.itl.median_ms:6.1f} ms  p99 {s.itl.p99_ms:7.1f} ms",
        f"  {s.output_throughput_tps:6.1f} out tok/s | goodput {goodput} | "
        f"handoff gap p50 {_ms(handoff, 50):6.1f} ms  p99 {_ms(handoff, 99):6.1f} ms",
    ]
    if state.num_requests:
        num_bytes = state.mean("splitserve_state_transfer_bytes")
        stream_s = state.mean("splitserve_state_stream_seconds")
        unhidden_s = state.mean("splitserve_state_transfer_seconds")
        lines.append(
            f"  state per request: {num_bytes / 2**20:6.2f} MiB streamed layer by layer over "
            f"{1e3 * stream_s:6.1f} ms (the final chunk's forward), of which {1e3 * unhidden_s:6.1f} ms "
            "was not overlapped with compute"
        )
    errors = Counter(r.error for r in result.records if not r.success)
    lines += [f"  {n} failed: {error}" for error, n in errors.most_common(3)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=6.0, help="Poisson arrivals per second")
    parser.add_argument("--input-len", type=int, default=512, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=48, help="mean output tokens")
    parser.add_argument(
        "--range-ratio", type=float, default=0.9, help="lengths uniform in len*(1-r)..len*(1+r)"
    )
    parser.add_argument("--slo", nargs="*", default=["ttft:1000", "tpot:50"], help="goodput SLOs (ms)")
    parser.add_argument("--kv-cache-memory", default="64MiB", help="per worker")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from bench.metrics import parse_slos
    from splitserve.tiny_model import make_tiny_model

    dataset = build_dataset(
        DatasetConfig(
            seed=args.seed,
            num_prompts=args.num_prompts,
            random_input_len=args.input_len,
            random_output_len=args.output_len,
            random_range_ratio=args.range_ratio,
        ),
        None,  # token-id prompts: no tokenizer needed
    )
    run = RunConfig(
        base_url="",
        model="tiny",
        request_rate=args.request_rate,
        seed=args.seed,
        slos_ms=parse_slos(args.slo),
    )
    prompt_tokens = sum(r.prompt_len for r in dataset.requests)
    output_tokens = sum(r.output_len for r in dataset.requests)
    print(
        f"{dataset.num_requests} requests at {args.request_rate}/s (Poisson), {prompt_tokens} prompt tokens "
        f"(mean {prompt_tokens / dataset.num_requests:.0f}), {output_tokens} output tokens; "
        f"goodput SLO {' '.join(args.slo)}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", seed=args.seed)
        for mode in MODES:
            print(report(mode, *run_mode(model, mode, dataset, run, args.kv_cache_memory)), flush=True)


if __name__ == "__main__":
    main()
