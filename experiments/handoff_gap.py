"""Experiment: the handoff gap (first token to second) of a request carrying >= 64 MiB of state.

    python -m experiments.handoff_gap [--prompt-tokens 256] [--busy 3] [--probes 5] [--nodes]

Builds the `handoff-64m` tiny model (8 KDA layers of 32 x 256 x 256 fp32 heads: ~64 MiB of
state per request whatever its length), starts a state store, a prefill, a decode and a
colocated worker in this process on 127.0.0.1, and drives each mode the way the gateway does
(Reserve, Prefill, Decode over gRPC). Per mode it measures, with the decode side idle and then
busy (`--busy` long requests decoding on it): the client's time to the first token (the
prefill's answer, after its state is sealed in the store) and the gap from that answer to the
first token the Decode stream yields. Prints the medians of `--probes` requests per cell, the
state each disaggregated request moved (bytes, and the prefill's put after its last layer), and
for a busy cell the time between two tokens of a background request (about one decode step),
so a gap can be read in steps.

With `--nodes` it compares where the state goes instead: two stores in this process stand for
two nodes (A: the prefill's, B: another), and a worker uses the arena of its own node's store
only, so state crossing "nodes" moves as gRPC bytes on loopback, as across two raylets. Cells:
`same-node` (the decode beside the prefill on A), `one-hop` (decode on B reads A's store, where
the prefill wrote through the arena: the default path), `two-hop` (the prefill sends the bytes
to B's store, the decode on B reads them there through the arena: the path before one hop).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from colocated_worker.actor import ColocatedWorkerActor
from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor
from splitserve.engine_config import EngineConfig
from splitserve.rpc import make_channel
from splitserve.sampling_params import SamplingParams
from splitserve.tiny_model import make_tiny_model
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from splitserve.wire import decode_request, prefill_request, sampling_params_to_proto
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

STATE_SLOT_BYTES = 70 << 20  # a little over one request's state on this model
PRESET = "handoff-64m"


@dataclass(frozen=True)
class Probe:
    ttft_s: float  # Prefill call to its answer (the first token)
    gap_s: float  # the first token's answer to the Decode stream's first token
    state_bytes: int
    state_put_s: float  # the prefill's put after its last layer (sealing included)
    state_wait_s: float  # of the gap: the decode worker waiting for the last of the state


class Client:
    """The gateway's Reserve -> Prefill -> Decode flow against one prefill and one decode address."""

    def __init__(self, prefill_address: str, decode_address: str, source_store: str = "") -> None:
        self.source = source_store  # the store the prefill writes into ("": the decode's own)
        self._channels = [make_channel(prefill_address), make_channel(decode_address)]
        self.prefill = prefill_pb2_grpc.PrefillStub(self._channels[0])
        self.decode = decode_pb2_grpc.DecodeStub(self._channels[1])

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def start(self, rid: str, prompt: list[int], params: SamplingParams) -> tuple[float, object, object]:
        """Reserve and prefill; returns (seconds to the first token, its answer, the Decode stream)."""
        reserve = decode_pb2.ReserveRequest(
            request_id=rid, num_prompt_tokens=len(prompt), timeout_s=120, source_store_address=self.source
        )
        reserved = self.decode.Reserve(reserve, timeout=120)
        if not reserved.accepted:
            raise RuntimeError(f"{rid}: the decode side refused a reservation ({reserved.reject_reason})")
        sp = sampling_params_to_proto(params)
        started = time.perf_counter()
        first = self.prefill.Prefill(prefill_request(rid, prompt, sp, reserved), timeout=300)
        ttft_s = time.perf_counter() - started
        stream = self.decode.Decode(decode_request(rid, prompt, sp, first), timeout=600)
        return ttft_s, first, stream

    def probe(self, rid: str, prompt: list[int]) -> Probe:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        ttft_s, first, stream = self.start(rid, prompt, params)
        answered = time.perf_counter()
        gap_s = state_wait_s = float("nan")
        for delta in stream:  # type: ignore[attr-defined]
            if delta.token_ids and gap_s != gap_s:
                gap_s = time.perf_counter() - answered
                state_wait_s = delta.timing.state_wait_s
        timing = first.timing  # type: ignore[attr-defined]
        return Probe(ttft_s, gap_s, timing.state_bytes, timing.state_put_s, state_wait_s)


class Background:
    """Long requests decoding on the decode side; remembers when each of their tokens came."""

    def __init__(self) -> None:
        self.token_times: list[list[float]] = []

    def step_s(self) -> float:
        """Median seconds between two tokens of one background request (~ one decode step)."""
        gaps = [b - a for times in self.token_times for a, b in zip(times, times[1:])]
        return statistics.median(gaps) if gaps else float("nan")


@contextmanager
def busy(client: Client, num_requests: int, prompt: list[int]) -> Iterator[Background]:
    """`num_requests` requests decoding on the decode side until the block ends."""
    streams: list[object] = []
    decoding = threading.Semaphore(0)
    background = Background()

    def run(index: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
        _, _, stream = client.start(f"busy-{index}-{time.monotonic_ns()}", prompt, params)
        streams.append(stream)
        times: list[float] = []
        background.token_times.append(times)
        try:
            for n, _ in enumerate(stream):  # type: ignore[attr-defined]
                times.append(time.perf_counter())
                if n == 0:
                    decoding.release()
        except grpc.RpcError:
            pass  # cancelled at the end of the block

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(num_requests)]
    for t in threads:
        t.start()
    for _ in threads:
        if not decoding.acquire(timeout=600):
            raise RuntimeError("background requests never started decoding")
    try:
        yield background
    finally:
        for stream in streams:
            stream.cancel()  # type: ignore[attr-defined]
        for t in threads:
            t.join(30)


def measure(client: Client, mode: str, load: str, args: argparse.Namespace) -> list[Probe]:
    prompt = [(7 * i + 3) % 200 + 10 for i in range(args.prompt_tokens)]
    probes = []
    for i in range(args.probes + 1):  # the first one warms up and is dropped
        probe = client.probe(f"{mode}-{load}-{i}", prompt)
        if i:
            probes.append(probe)
    return probes


def report(mode: str, load: str, probes: list[Probe]) -> str:
    def median_ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values)

    return (
        f"{mode:13s} {load:5s} ttft {median_ms([p.ttft_s for p in probes]):8.1f} ms   "
        f"gap {median_ms([p.gap_s for p in probes]):7.1f} ms "
        f"(min {1e3 * min(p.gap_s for p in probes):6.1f}, max {1e3 * max(p.gap_s for p in probes):6.1f})   "
        f"of it waiting for state {median_ms([p.state_wait_s for p in probes]):6.1f} ms   "
        f"state {statistics.median([p.state_bytes for p in probes]) / 2**20:6.1f} MiB   "
        f"put after last layer {median_ms([p.state_put_s for p in probes]):6.1f} ms"
    )


def start_store(stack: ExitStack, memory_bytes: int) -> StateStoreServer:
    """A store and its gRPC server on 127.0.0.1, both closed with `stack`."""
    store = StateStore.from_config(StoreConfig(memory_bytes=memory_bytes))
    stack.callback(store.close)
    server = StateStoreServer(store, "127.0.0.1", 0)
    stack.callback(server.stop, grace_s=0)
    return server


def compare_nodes(
    stack: ExitStack, config: EngineConfig, store_a: str, store_b: str, args: argparse.Namespace
) -> None:
    """The handoff gap with the decode on the prefill's node, and on another node by one hop and
    by two (see the module's docstring), idle and busy."""
    workers = {
        "prefill": PrefillWorkerActor(config, store_a),
        "decode-a": DecodeWorkerActor(config, store_a),
        "decode-b": DecodeWorkerActor(config, store_b),
    }
    addresses = {name: w.start("127.0.0.1", 0) for name, w in workers.items()}
    for w in workers.values():
        stack.callback(w.shutdown)
    clients = {
        "same-node": Client(addresses["prefill"], addresses["decode-a"], store_a),
        "one-hop": Client(addresses["prefill"], addresses["decode-b"], store_a),
        "two-hop": Client(addresses["prefill"], addresses["decode-b"], ""),
    }
    for c in clients.values():
        stack.callback(c.close)
    print(
        f"{PRESET}, prompt {args.prompt_tokens} tokens, prefill chunks of {args.chunk_tokens}, "
        f"busy = {args.busy} requests decoding, median of {args.probes} probes; two stores in one "
        "process as two nodes, cross-node bytes over gRPC on loopback"
    )
    background = [(i * 5 + 1) % 200 + 10 for i in range(16)]
    for name, client in clients.items():
        print(report(name, "idle", measure(client, name, "idle", args)), flush=True)
        if args.busy:
            with busy(client, args.busy, background) as load:
                print(report(name, "busy", measure(client, name, "busy", args)), flush=True)
            print(f"{'':19s} (busy: one decode step ~{1e3 * load.step_s():.0f} ms between two tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--busy", type=int, default=3, help="requests decoding on the decode side when busy")
    parser.add_argument(
        "--probes", type=int, default=5, help="measured requests per cell (after one warm-up)"
    )
    parser.add_argument("--chunk-tokens", type=int, default=64, help="the prefill's max_num_batched_tokens")
    parser.add_argument("--model", type=Path, default=None, help=f"a {PRESET} checkpoint (default: built)")
    parser.add_argument("--nodes", action="store_true", help="same-node vs one-hop vs two-hop instead")
    args = parser.parse_args()
    with ExitStack() as stack:
        model = args.model or make_tiny_model(
            Path(stack.enter_context(tempfile.TemporaryDirectory())) / PRESET, preset=PRESET, seed=0
        )
        num_seqs = args.busy + 2
        config = EngineConfig(
            model=str(model),
            max_model_len=args.prompt_tokens + 512,
            max_num_batched_tokens=args.chunk_tokens,
            max_num_seqs=num_seqs,
            kv_cache_memory_bytes=num_seqs * STATE_SLOT_BYTES + (64 << 20),
        )
        server = start_store(stack, (num_seqs + 2) * STATE_SLOT_BYTES)
        if args.nodes:
            compare_nodes(stack, config, server.address, start_store(stack, 3 * STATE_SLOT_BYTES).address, args)
            return
        workers = {
            "prefill": PrefillWorkerActor(config, server.address),
            "decode": DecodeWorkerActor(config, server.address),
            "colocated": ColocatedWorkerActor(config),
        }
        addresses = {name: w.start("127.0.0.1", 0) for name, w in workers.items()}
        for w in workers.values():
            stack.callback(w.shutdown)
        clients = {
            "disaggregated": Client(addresses["prefill"], addresses["decode"]),
            "colocated": Client(addresses["colocated"], addresses["colocated"]),
        }
        for c in clients.values():
            stack.callback(c.close)
        print(
            f"{PRESET}, prompt {args.prompt_tokens} tokens, prefill chunks of {args.chunk_tokens}, "
            f"busy = {args.busy} requests decoding, median of {args.probes} probes"
        )
        background = [(i * 5 + 1) % 200 + 10 for i in range(16)]
        for mode, client in clients.items():
            print(report(mode, "idle", measure(client, mode, "idle", args)), flush=True)
            with busy(client, args.busy, background) as load:
                print(report(mode, "busy", measure(client, mode, "busy", args)), flush=True)
            print(f"{'':19s} (busy: one decode step ~{1e3 * load.step_s():.0f} ms between two tokens)")


if __name__ == "__main__":
    main()
