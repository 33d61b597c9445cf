"""Benchmark: what the gateway alone costs, in requests/s and in added latency, in one run.

    python -m experiments.gateway_overhead [--num-requests 500] [--concurrency 1 16 64]
        [--output-len 1 32] [--input-len 128] [--tokens-per-delta 1] [--token-ids] [--disable-tqdm]

Behind the gateway sits an instant worker (`instant_worker.py`: the real Prefill and Decode
gRPC services, answering at once), so nearly all the time a request spends is the gateway's
and the transports'. Three processes: the worker, the real gateway (its app, router, worker
clients and load monitor, under uvicorn) and this one, which drives both paths in turn at
each concurrency (closed loop: every lane sends its next request when the last one ends):

* worker alone: the gateway's own RPC sequence (Reserve, Prefill, then the Decode stream, or
  an Abort of the reservation when the prefill already finished it) from a grpc.aio client;
* through the gateway: streaming completions over HTTP with `splitserve bench`'s runner, the
  same prompts (text, tokenized by the gateway; `--token-ids` sends ids instead). That client
  stops reading at `data: [DONE]`, so httpx drops the connection and every request opens a new
  one: the gateway path pays a TCP connect and accept per request, as under `bench serve`.

It prints two tables: TTFT and end-to-end p50/p99 of both paths and what the gateway adds
(the difference of the two percentiles, not a percentile of differences); then requests/s of
both, their ratio, and the CPU each process spent per request (from /proc, all threads), which
says where the gateway path's time goes. The HTTP client's own cost (httpx, SSE parsing) counts
as the gateway's in the latencies; its CPU column shows how much. Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import httpx
from tqdm import tqdm

from bench.datasets import Dataset, DatasetConfig, build_dataset
from bench.runner import RunConfig, run_benchmark
from experiments.gateway_overhead_report import (
    Cell,
    CpuPerRequest,
    PathFigures,
    failures,
    latency_table,
    throughput_table,
)
from experiments.instant_worker import InstantConfig, instant_worker_process
from experiments.server_process import ServerProcess, cpu_seconds, wait_until_told
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import Tokenizer
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from splitserve.wire import decode_request, prefill_request, sampling_params_to_proto

MODEL = "instant"
WARM_UP_REQUESTS = 32
RPC_TIMEOUT_S = 30.0


# The worker alone --------------------------------------------------------------------------------


async def drive_worker(
    channel: grpc.aio.Channel, prompts: Sequence[list[int]], output_len: int, concurrency: int, run_id: str
) -> PathFigures:
    """Every prompt through Reserve → Prefill → Decode over `channel`, `concurrency` at a time."""
    params = sampling_params_to_proto(SamplingParams(max_tokens=output_len, ignore_eos=True))
    prefill, decode = prefill_pb2_grpc.PrefillStub(channel), decode_pb2_grpc.DecodeStub(channel)
    samples: list[tuple[float, float, int]] = []
    errors: list[str] = []
    work = iter(enumerate(prompts))

    async def lane() -> None:
        for index, ids in work:
            try:
                samples.append(await _one_direct(prefill, decode, f"{run_id}-{index}", ids, params))
            except (grpc.aio.AioRpcError, RuntimeError) as exc:
                errors.append(str(exc))

    start_s = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return PathFigures.of(samples, errors, time.perf_counter() - start_s)


async def _one_direct(
    prefill: prefill_pb2_grpc.PrefillStub,
    decode: decode_pb2_grpc.DecodeStub,
    request_id: str,
    ids: list[int],
    params: Any,
) -> tuple[float, float, int]:
    """One request as the gateway runs it; (ttft_s, e2e_s, output tokens)."""
    send_s = time.perf_counter()
    reserve = decode_pb2.ReserveRequest(
        request_id=request_id, num_prompt_tokens=len(ids), max_tokens=params.max_tokens, timeout_s=120.0
    )
    reservation = await decode.Reserve(reserve, timeout=RPC_TIMEOUT_S)
    if not reservation.accepted:
        raise RuntimeError(f"Reserve rejected {request_id}: {reservation.reject_reason}")
    response = await prefill.Prefill(
        prefill_request(request_id, ids, params, reservation), timeout=RPC_TIMEOUT_S
    )
    first_s = time.perf_counter()
    num_tokens = 1
    if response.finish_reason:  # nothing to decode: give the reservation back, as the gateway does
        await decode.Abort(decode_pb2.AbortDecodeRequest(request_id=request_id), timeout=RPC_TIMEOUT_S)
    else:
        request = decode_request(request_id, ids, params, response)
        async for delta in decode.Decode(request, timeout=RPC_TIMEOUT_S):
            num_tokens += len(delta.token_ids)
    return first_s - send_s, time.perf_counter() - send_s, num_tokens


# Through the gateway -----------------------------------------------------------------------------


def _serve_gateway(
    conn: Connection, worker_address: str, tokenizer_path: str | None, settings: dict[str, Any]
) -> None:
    """The gateway process's body: the real app on uvicorn, one worker in both pools."""
    from frontend.app import build_app
    from frontend.router import LeastLoadRouter
    from frontend.server import GatewayServer
    from frontend.settings import GatewaySettings

    router = LeastLoadRouter([worker_address], [worker_address])
    app = build_app(GatewaySettings(**settings), tokenizer_path, router)
    server = GatewayServer(app, "127.0.0.1", 0, freeze_heap=True)  # as the gateway actor serves
    server.start()
    try:
        conn.send(server.url)
        wait_until_told(conn)
    finally:
        server.stop()


def gateway_process(worker_address: str, tokenizer_path: Path | None, max_model_len: int) -> ServerProcess:
    """The real gateway in its own process, in front of `worker_address` (not started)."""
    settings = {"model_name": MODEL, "max_model_len": max_model_len, "port": 0}
    path = str(tokenizer_path) if tokenizer_path is not None else None
    return ServerProcess(_serve_gateway, (worker_address, path, settings), "gateway")


async def drive_gateway(
    client: httpx.AsyncClient, url: str, dataset: Dataset, concurrency: int
) -> PathFigures:
    """`dataset` as streaming completions through the gateway at `url`, `concurrency` at a time."""
    config = RunConfig(base_url=url, model=MODEL, max_concurrency=concurrency, disable_tqdm=True)
    result = await run_benchmark(dataset, config, client=client)
    samples = [
        (r.ttft_s, r.e2e_s, r.output_tokens)
        for r in result.records
        if r.success and r.ttft_s is not None and r.e2e_s is not None
    ]
    errors = [r.error for r in result.records if not r.success]
    return PathFigures.of(samples, errors, result.summary.duration_s)


# The sweep ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What each run sends: the HTTP dataset and the same prompts as token ids for the worker."""

    dataset: Dataset
    prompt_ids: tuple[list[int], ...]


def build_workload(
    num_requests: int, input_len: int, output_len: int, tokenizer: Tokenizer | None, seed: int
) -> Workload:
    from frontend.inputs import tokenize_prompt  # exactly the ids the gateway will send

    config = DatasetConfig(
        seed=seed, num_prompts=num_requests, random_input_len=input_len, random_output_len=output_len
    )
    dataset = build_dataset(config, tokenizer)
    ids = tuple(
        tokenize_prompt(r.prompt if isinstance(r.prompt, str) else list(r.prompt), tokenizer)
        for r in dataset.requests
    )
    return Workload(dataset, ids)


@dataclass(frozen=True)
class Servers:
    """The two processes a sweep drives and meters."""

    worker: ServerProcess
    gateway: ServerProcess

    def cpu_s(self) -> tuple[float, float, float]:
        """CPU seconds used so far by the worker, the gateway and this process (the clients)."""
        return self.worker.cpu_seconds(), self.gateway.cpu_seconds(), cpu_seconds()


async def _metered(run: Awaitable[PathFigures], servers: Servers) -> PathFigures:
    """`run`'s figures with the CPU every process spent on them, per completed request."""
    before = servers.cpu_s()
    figures = await run
    after = servers.cpu_s()
    num_requests = max(figures.num_completed, 1)
    worker_ms, gateway_ms, client_ms = (1e3 * (a - b) / num_requests for a, b in zip(after, before))
    return dataclasses.replace(figures, cpu=CpuPerRequest(worker_ms, gateway_ms, client_ms))


async def sweep(
    servers: Servers, workloads: dict[int, Workload], concurrencies: Sequence[int], disable_tqdm: bool = False
) -> list[Cell]:
    """Both paths at every (output length, concurrency), the worker alone first each time.

    One gRPC channel and one httpx client serve the whole sweep, as the gateway keeps its
    channels; a warm-up at the highest concurrency goes first.
    """
    from frontend.clients import CHANNEL_OPTIONS  # the options the gateway's own channels use

    url, max_concurrency = servers.gateway.address, max(concurrencies)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    cells = []
    async with (
        grpc.aio.insecure_channel(servers.worker.address, options=CHANNEL_OPTIONS) as channel,
        httpx.AsyncClient(timeout=httpx.Timeout(RPC_TIMEOUT_S * 4), limits=limits) as client,
    ):
        first = next(iter(workloads.values()))
        warm = first.dataset.requests[: max(WARM_UP_REQUESTS, 2 * max_concurrency)]
        warm_ids = first.prompt_ids[: len(warm)]
        await drive_worker(channel, warm_ids, warm[0].output_len, max_concurrency, "warm")
        await drive_gateway(client, url, dataclasses.replace(first.dataset, requests=warm), max_concurrency)
        rows = [(n, w, c) for n, w in workloads.items() for c in concurrencies]
        for output_len, workload, concurrency in tqdm(
            rows, desc="gateway overhead", unit="row", disable=disable_tqdm
        ):
            run_id = f"direct-{output_len}-{concurrency}"
            alone = drive_worker(channel, workload.prompt_ids, output_len, concurrency, run_id)
            worker = await _metered(alone, servers)
            via = drive_gateway(client, url, workload.dataset, concurrency)
            cells.append(Cell(output_len, concurrency, worker, await _metered(via, servers)))
    return cells


def main(argv: list[str] | None = None) -> list[Cell]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=500, help="per path, per row")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--output-len", type=int, nargs="+", default=[1, 32], help="tokens per request")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--tokens-per-delta", type=int, default=1, help="tokens per Decode message")
    parser.add_argument("--token-ids", action="store_true", help="send token ids, not text, to the gateway")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disable-tqdm", action="store_true")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or min(args.output_len) < 1 or args.num_requests < 1:
        parser.error("--num-requests, --concurrency and --output-len must all be at least 1")
    from splitserve.tokenizer_files import write_tokenizer_files

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path = Path(tmp) / "tokenizer"
        write_tokenizer_files(tokenizer_path)
        tokenizer = Tokenizer(tokenizer_path)
        prompts_tokenizer = None if args.token_ids else tokenizer
        workloads = {
            n: build_workload(args.num_requests, args.input_len, n, prompts_tokenizer, args.seed)
            for n in args.output_len
        }
        max_model_len = max(4096, args.input_len + max(args.output_len) + 64)
        eos = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
        worker_config = InstantConfig(tokens_per_delta=args.tokens_per_delta, eos_token_id=eos)
        print(
            f"{args.num_requests} requests per path per row, closed loop; {'token-id' if args.token_ids else 'text'} "
            f"prompts of {args.input_len} tokens, streamed, EOS ignored, {args.tokens_per_delta} "
            f"token(s) per Decode delta; instant worker, gateway and clients in 3 processes on "
            f"{os.cpu_count()} CPU(s)",
            flush=True,
        )
        with (
            instant_worker_process(worker_config) as worker,
            gateway_process(worker.address, tokenizer_path, max_model_len) as gateway,
        ):
            cells = asyncio.run(
                sweep(Servers(worker, gateway), workloads, args.concurrency, args.disable_tqdm)
            )
    print("\nlatency, ms (what the gateway adds: its percentile minus the worker's, one by one)")
    print(latency_table(cells))
    print("\nthroughput, and CPU per request of each process (all threads)")
    print(throughput_table(cells))
    lost = failures(cells)
    if lost:
        print("\n" + lost)
    return cells


if __name__ == "__main__":
    main()
