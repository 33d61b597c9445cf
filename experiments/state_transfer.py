"""Benchmark: same-node state transfer through the store, shared memory vs gRPC bytes vs memcpy.

    python -m experiments.state_transfer [--sizes-mib 1 16 64 256] [--repeats 5] [--piece-mib 2]

For each size, a fp32 state in layer-sized pieces (default 2 MiB: one Kimi-Linear-48B KDA layer,
32x128x128 fp32) goes through a real StateStore gRPC server on 127.0.0.1, in its own process as
on a node, as a prefill writes it
(`StateStoreClient.open_put` + `PutStream.write_state` per piece, `finish`) and comes back as a
decode reads it (`get`, every chunk's checksum verified by the client), once over the store's
shared-memory arena (one copy in, zero-copy views out) and once as bytes over gRPC (the path of
a reader on another node). As in a real handoff the reader's Get waits on the key before the
writer starts (a decode reservation), so writing and reading overlap; a transfer ends when the
reader holds every chunk, verified. `shm` stops there (zero-copy views); `shm+scatter` and
`gRPC` also copy each chunk into one destination array (the engine's scatter into its cache).
Next to them, a memcpy of the same bytes into warm memory (numpy.copyto). Prints best-of-
`repeats` GB/s and the fraction of memcpy. Figures only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import numpy as np

from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

_keys = itertools.count()
_done_keys: list[str] = []


def _best_s(fn: Callable[[], object], repeats: int, client: StateStoreClient | None = None) -> float:
    """The fastest of `repeats` runs of `fn`, releasing the keys each left (untimed)."""
    best_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best_s = min(best_s, time.perf_counter() - start)
        while client is not None and _done_keys:
            client.release(_done_keys.pop())
    return best_s


def handoff(client: StateStoreClient, pieces: list[np.ndarray], out: np.ndarray | None, shm: bool) -> None:
    """One request's handoff: the reader waits on the key (a decode reservation) while the writer
    puts `pieces` as its layers; returns once every chunk is verified in the reader's hands
    (and copied into `out`, as the engine's scatter, unless `out` is None)."""
    key = f"bench-{next(_keys)}"
    stream = client.get(key, timeout_s=300, wait_for_key=True, shared_memory=shm)
    errors: list[BaseException] = []

    def read() -> None:
        flat = None if out is None else out.view(np.uint8)
        start = 0
        try:
            for chunk in stream:
                end = start + len(chunk.data)
                if flat is not None:
                    flat[start:end] = np.frombuffer(chunk.data, np.uint8)
                start = end
        except BaseException as e:  # noqa: BLE001 - raised again on the writer's thread
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    num_bytes = sum(p.nbytes for p in pieces)
    put = client.open_put(key, owner="bench", shared_memory=shm, expected_bytes=num_bytes)
    for layer, piece in enumerate(pieces):
        put.write_state(
            layer,
            StateKind.KDA_RECURRENT,
            piece.data,
            dtype="float32",
            shape=piece.shape,
            token_start=0,
            token_end=1,
        )
    put.finish(timeout_s=300)
    reader.join()
    _done_keys.append(key)  # released after the timing: a decode releases once it has the state
    if errors:
        raise errors[0]


def measure(client: StateStoreClient, mib: int, piece_mib: float, repeats: int) -> list[float]:
    """GB/s of memcpy, shm, shm+scatter and gRPC for `mib` MiB."""
    data = np.random.default_rng(mib).standard_normal(mib << 18).astype(np.float32)
    rows = max(128, int(piece_mib * (1 << 18)) // 128 * 128)
    pieces = [data[i : i + rows].reshape(-1, 128) for i in range(0, len(data), rows)]
    out = np.empty_like(data)
    times = [_best_s(lambda: np.copyto(out, data), repeats)]
    for scatter_to, shm in ((None, True), (out, True), (out, False)):
        out[:] = 0
        times.append(_best_s(functools.partial(handoff, client, pieces, scatter_to, shm), repeats, client))
        assert scatter_to is None or np.array_equal(out, data)
    return [data.nbytes / t / 1e9 for t in times]


def serve_store(memory_bytes: int, address_out: Connection, stop: Event) -> None:
    """A store in its own process, as on a node (its Ray actor): sends its address, serves until `stop`."""
    store = StateStore.from_config(StoreConfig(memory_bytes=memory_bytes))
    server = StateStoreServer(store)
    address_out.send(server.address)
    stop.wait()
    server.stop(grace_s=0)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--piece-mib", type=float, default=2.0)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    stop = context.Event()
    store_process = context.Process(target=serve_store, args=(3 * max(args.sizes_mib) << 20, send, stop))
    store_process.start()
    client = StateStoreClient(receive.recv(), timeout_s=300)
    assert client.local_arena() is not None, "no shared-memory arena: is /dev/shm there?"
    print(
        f"{'size':>8} {'memcpy':>7} {'shm':>6} {'':>5} {'shm+scatter':>11} {'':>5} {'gRPC':>6} {'':>5}  GB/s"
    )
    try:
        for mib in args.sizes_mib:
            copy, shm, scatter, grpc_ = measure(client, mib, args.piece_mib, args.repeats)
            print(
                f"{mib:>5} MiB {copy:7.2f} {shm:6.2f} {shm / copy:5.0%} {scatter:11.2f} {scatter / copy:5.0%} "
                f"{grpc_:6.2f} {grpc_ / copy:5.0%}"
            )
    finally:
        client.close()
        stop.set()
        store_process.join(30)


if __name__ == "__main__":
    main()
