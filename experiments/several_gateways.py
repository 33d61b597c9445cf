"""Benchmark: one-token requests/s and gateway CPU per request at 1, 2 and 4 gateway processes on
one port, side by side in one run.

    python -m experiments.several_gateways [--gateways 1 2 4] [--num-requests 2000]
        [--concurrency 32] [--rounds 2] [--input-len 128] [--idle-s 3]

The gateways run as a deployment with `gateway.replicas: N` runs them: N `GatewayActor`s on local
Ray sharing one port (SO_REUSEPORT, each with `num_gateways` N), admitting through one
`LedgerActor` when N > 1 (one gateway admits alone, as `replicas: 1` does); the default router
(prefix-aware). Behind them an instant worker (`instant_worker.py`: the real gRPC services doing
no work) in its own process serves both pools. This process is the client: streamed completions
of `--input-len`-token text prompts with `max_tokens` 1 through the shared port with
`splitserve bench`'s runner, closed loop at `--concurrency`. The runner drops each connection at
`data: [DONE]`, so every request opens a new one and the kernel picks a gateway process for it.

For each count it prints requests/s and the CPU (user + system, all threads, read from
/proc/PID/stat of each process) spent per completed request by the gateway processes together,
by the ledger, the worker and the client, and how the requests spread over the gateway processes
(each one's own `/metrics`, on its own port); and, before the run, what the gateway processes
spend idle (their polls of the worker, Ray's threads), in CPU ms per second. Rounds repeat the counts in turn, so a neighbour's
load falls on each alike. Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from experiments.gateway_overhead import MODEL, RPC_TIMEOUT_S, Workload, build_workload, drive_gateway
from experiments.gateway_overhead_report import PathFigures
from experiments.instant_worker import InstantConfig, instant_worker_process
from experiments.server_process import ServerProcess, cpu_seconds
from frontend.settings import GatewaySettings
from splitserve.tokenizer import Tokenizer
from splitserve.tokenizer_files import write_tokenizer_files

MAX_QUEUED_REQUESTS = 1024  # the config's default
WARM_UP_PER_LANE = 4  # requests per lane before a count is measured (channels open, slots lent)


@dataclass
class GatewayGroup:
    """N gateway actors on one port and, with more than one, their ledger; stops them all."""

    handles: list[Any]
    ledger: Any | None
    pids: list[int]
    ledger_pid: int | None
    url: str  # the shared port
    own_urls: list[str]  # each process's own port

    def stop(self) -> None:
        import ray

        ray.get([h.shutdown.remote(0.0) for h in self.handles], timeout=60)
        for handle in [*self.handles, *([self.ledger] if self.ledger is not None else [])]:
            ray.kill(handle, no_restart=True)


def _pid_of(actor: Any) -> int:
    return os.getpid()


def start_group(
    num_gateways: int, worker_address: str, tokenizer_path: Path, max_model_len: int
) -> GatewayGroup:
    """Start `num_gateways` gateway actors on one port (with their ledger when several), each told
    the instant worker is both pools, as the controller does."""
    import ray

    from frontend.actor import remote_gateway_actor
    from frontend.ledger_actor import remote_ledger_actor

    ledger = None
    if num_gateways > 1:
        ledger = remote_ledger_actor(num_cpus=0).remote(MAX_QUEUED_REQUESTS)
    settings: dict[str, Any] = {
        "model_name": MODEL,
        "model_path": str(tokenizer_path),
        "max_model_len": max_model_len,
        "num_gateways": num_gateways,
        "max_queued_requests": MAX_QUEUED_REQUESTS,
    }
    gateway_class = remote_gateway_actor(num_cpus=0)
    handles, port, address = [], 0, ""
    for index in range(num_gateways):
        handle = gateway_class.remote(GatewaySettings(**settings))
        if ledger is not None:
            ray.get(handle.use_ledger.remote(ledger, index), timeout=60)
        address = ray.get(handle.start.remote("127.0.0.1", port), timeout=60)
        port = int(address.rpartition(":")[2])  # the first bound a free port; the others join it
        ray.get(handle.update_workers.remote([worker_address], [worker_address]), timeout=60)
        handles.append(handle)
    pids = ray.get([h.__ray_call__.remote(_pid_of) for h in handles], timeout=60)
    own = [ray.get(h.health.remote(), timeout=60)["own_address"] for h in handles]
    ledger_pid = ray.get(ledger.__ray_call__.remote(_pid_of), timeout=60) if ledger is not None else None
    return GatewayGroup(handles, ledger, pids, ledger_pid, f"http://{address}", [f"http://{a}" for a in own])


def completions_served(url: str) -> int:
    """Completions one gateway process answered 200, from the /metrics on its own port."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "splitserve_http_responses_total"
            and sample.labels.get("route") == "/v1/completions"
            and sample.labels.get("status_code") == "200"
        )
    )


@dataclass(frozen=True)
class Row:
    """One count's run: its figures and CPU milliseconds per completed request by process."""

    num_gateways: int
    figures: PathFigures
    gateways_ms: float  # all gateway processes together
    ledger_ms: float  # NaN without a ledger
    worker_ms: float
    client_ms: float
    served: tuple[int, ...]  # completions per gateway process during the run
    idle_ms_per_s: float  # CPU ms per second the gateway processes together spend with no request


def _cpu(group: GatewayGroup, worker: ServerProcess) -> tuple[float, float, float, float]:
    ledger = cpu_seconds(group.ledger_pid) if group.ledger_pid is not None else math.nan
    return sum(cpu_seconds(p) for p in group.pids), ledger, worker.cpu_seconds(), cpu_seconds()


async def measure(
    group: GatewayGroup, worker: ServerProcess, workload: Workload, concurrency: int, idle_s: float
) -> Row:
    """Warm the group up, meter it idle for `idle_s`, then run `workload` through its shared port
    and meter every process."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(RPC_TIMEOUT_S * 4), limits=limits) as client:
        warm = workload.dataset.requests[: WARM_UP_PER_LANE * concurrency]
        await drive_gateway(
            client, group.url, dataclasses.replace(workload.dataset, requests=warm), concurrency
        )
        idle_before = _cpu(group, worker)[0]
        await asyncio.sleep(idle_s)  # a meter's window, not a synchronisation
        idle_ms_per_s = 1e3 * (_cpu(group, worker)[0] - idle_before) / idle_s
        served_before = [completions_served(u) for u in group.own_urls]
        before = _cpu(group, worker)
        figures = await drive_gateway(client, group.url, workload.dataset, concurrency)
        after = _cpu(group, worker)
    served = tuple(completions_served(u) - b for u, b in zip(group.own_urls, served_before, strict=True))
    gateways_ms, ledger_ms, worker_ms, client_ms = (
        1e3 * (a - b) / max(figures.num_completed, 1) for a, b in zip(after, before, strict=True)
    )
    return Row(
        len(group.handles), figures, gateways_ms, ledger_ms, worker_ms, client_ms, served, idle_ms_per_s
    )


def table(rows: Sequence[Row]) -> str:
    """One line per run, then the median of each count's runs."""
    header = (
        "| gateway processes | req/s | gateway CPU ms/req (all processes) | ledger ms/req | worker ms/req "
        "| client ms/req | requests per process | failed | gateways idle, CPU ms/s |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for row in sorted(rows, key=lambda r: r.num_gateways):
        f = row.figures
        lines.append(
            f"| {row.num_gateways} | {f.num_completed / f.duration_s:.0f} | {row.gateways_ms:.2f} "
            f"| {_ms(row.ledger_ms)} | {row.worker_ms:.2f} | {row.client_ms:.2f} "
            f"| {' / '.join(map(str, row.served))} | {f.num_failed} | {row.idle_ms_per_s:.1f} |"
        )
    lines.append(
        "\nmedian over the rounds:\n| gateway processes | req/s | gateway CPU ms/req |\n|---|---|---|"
    )
    for count in sorted({r.num_gateways for r in rows}):
        mine = [r for r in rows if r.num_gateways == count]
        rate = statistics.median(r.figures.num_completed / r.figures.duration_s for r in mine)
        lines.append(f"| {count} | {rate:.0f} | {statistics.median(r.gateways_ms for r in mine):.2f} |")
    return "\n".join(lines)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2, 4], help="gateway process counts")
    parser.add_argument("--num-requests", type=int, default=2000, help="per count, per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--idle-s", type=float, default=3.0, help="how long the idle gateways are metered")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.gateways) < 1 or min(args.num_requests, args.concurrency, args.rounds) < 1:
        parser.error("--gateways, --num-requests, --concurrency and --rounds must all be at least 1")
    if args.idle_s <= 0:
        parser.error("--idle-s must be positive")
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path = Path(tmp) / "tokenizer"
        write_tokenizer_files(tokenizer_path)
        workload = build_workload(args.num_requests, args.input_len, 1, Tokenizer(tokenizer_path), args.seed)
        max_model_len = max(4096, args.input_len + 64)
        print(
            f"{args.num_requests} one-token requests per count per round, closed loop at concurrency "
            f"{args.concurrency}, text prompts of {args.input_len} tokens, a new connection each; "
            f"gateways as Ray actors on one port, an instant worker, the client here; {os.cpu_count()} CPU(s)",
            flush=True,
        )
        ray.init(num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False, log_to_driver=False)
        rows = []
        try:
            with instant_worker_process(InstantConfig()) as worker:
                for round_index in range(args.rounds):
                    for count in args.gateways:
                        group = start_group(count, worker.address, tokenizer_path, max_model_len)
                        try:
                            rows.append(
                                asyncio.run(measure(group, worker, workload, args.concurrency, args.idle_s))
                            )
                        finally:
                            group.stop()
                        print(f"round {round_index + 1}, {count} gateway(s): done", flush=True)
        finally:
            ray.shutdown()
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
