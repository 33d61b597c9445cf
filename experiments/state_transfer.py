"""Benchmark: same-node state transfer through the store, shared memory vs gRPC bytes vs memcpy.

    python -m experiments.state_transfer [--sizes-mib 1 16 64 256] [--repeats 3] [--piece-mib 2]

For each size, a fp32 state in layer-sized pieces (default 2 MiB: one Kimi-Linear-48B KDA layer,
32x128x128 fp32) goes through a real StateStore gRPC server on 127.0.0.1 as a prefill writes it
(`StateStoreClient.open_put` + `PutStream.write_state` per piece, `finish`) and comes back as a
decode reads it (`get`, every chunk's checksum verified by the client), once over the store's
shared-memory arena (one copy in, zero-copy views out) and once as bytes over gRPC (the path of
a reader on another node). The reader copies each chunk into one destination array (the
engine's scatter into its cache). Next to them, a memcpy of the same bytes (numpy.copyto).
Prints best-of-`repeats` GB/s of each round trip and its fraction of memcpy. Figures only.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import numpy as np

from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

_keys = itertools.count()


def _best_s(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def round_trip(client: StateStoreClient, pieces: list[np.ndarray], out: np.ndarray, shm: bool) -> None:
    """Writes `pieces` as one key's layers, reads them back into `out`, releases the key."""
    key = f"bench-{next(_keys)}"
    put = client.open_put(key, owner="bench", shared_memory=shm, expected_bytes=out.nbytes)
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
    flat = out.view(np.uint8)
    start = 0
    for chunk in client.get(key, timeout_s=300, shared_memory=shm):
        end = start + len(chunk.data)
        flat[start:end] = np.frombuffer(chunk.data, np.uint8)  # the engine's scatter
        start = end
    client.release(key)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--piece-mib", type=float, default=2.0)
    args = parser.parse_args()
    store = StateStore.from_config(StoreConfig(memory_bytes=3 * max(args.sizes_mib) << 20))
    server = StateStoreServer(store)
    client = StateStoreClient(server.address, timeout_s=300)
    assert client.local_arena() is not None, "no shared-memory arena: is /dev/shm there?"
    print(
        f"{'size':>8} {'memcpy GB/s':>12} {'shm GB/s':>9} {'shm/memcpy':>11} {'gRPC GB/s':>10} {'gRPC/memcpy':>12}"
    )
    try:
        for mib in args.sizes_mib:
            data = np.random.default_rng(mib).standard_normal(mib << 18).astype(np.float32)
            piece_rows = max(1, min(len(data), int(args.piece_mib * (1 << 18))))
            pieces = [
                data[i : i + piece_rows].reshape(-1, 128)
                if piece_rows % 128 == 0
                else data[i : i + piece_rows]
                for i in range(0, len(data), piece_rows)
            ]
            out = np.empty_like(data)
            copy_s = _best_s(lambda out=out, data=data: np.copyto(out, data), args.repeats)
            shm_s = _best_s(lambda p=pieces, o=out: round_trip(client, p, o, True), args.repeats)
            assert np.array_equal(out, data)
            grpc_s = _best_s(lambda p=pieces, o=out: round_trip(client, p, o, False), args.repeats)
            assert np.array_equal(out, data)
            num_bytes = data.nbytes
            copy, shm, grpc_ = (num_bytes / t / 1e9 for t in (copy_s, shm_s, grpc_s))
            print(
                f"{mib:>5} MiB {copy:12.2f} {shm:9.2f} {shm / copy:10.0%} {grpc_:10.2f} {grpc_ / copy:11.0%}"
            )
    finally:
        client.close()
        server.stop(grace_s=0)
        store.close()


if __name__ == "__main__":
    main()
