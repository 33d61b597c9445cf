"""Benchmark: state transfer through the store, shared memory vs transfer engine vs gRPC vs memcpy.

    python -m experiments.state_transfer [--sizes-mib 1 16 64 256] [--repeats 5] [--piece-mib 2]

Three processes, as on a node: a real StateStore gRPC server on 127.0.0.1 (its own process, as
its Ray actor), a writer (this process, as a prefill) and a reader (its own process, as a
decode). For each size, a fp32 state in layer-sized pieces (default 2 MiB: one Kimi-Linear-48B
KDA layer, 32x128x128 fp32) is written as a prefill writes it (`StateStoreClient.open_put` +
`PutStream.write_state` per piece, `finish`) and read as a decode reads it (`get`, every chunk's
checksum verified by the client). As in a real handoff the reader's Get waits on the key before
the writer starts (a decode reservation), so writing and reading overlap; a transfer ends when
the reader holds every chunk, verified (its clock, `time.perf_counter`, is CLOCK_MONOTONIC, the
writer's too; the pipe that tells the writer so is not timed). Transports:

* `shm`: the store's shared-memory arena, one copy in, zero-copy views out, the writer's first
  region leased ahead when its previous put finished (`spare_region`; `--no-spare-region`:
  allocated when the put opens); `shm+scatter` also
  copies each chunk into one destination array (the engine's scatter into its cache);
* `gRPC`: the bytes streamed by the store (a reader on another node without a transfer engine);
* `mooncake`: the reader pulls the arena's regions through Mooncake Transfer Engine over TCP on
  loopback (a reader on another node with `store.transfer_engine: mooncake`), into buffers of
  its own, then scatters; n/a where the extra or libibverbs is missing.

`gRPC` and `mooncake` scatter too. Next to them, a memcpy of the same bytes into warm memory
(numpy.copyto). Prints best-of-`repeats` GB/s and the fraction of memcpy. Figures only.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import numpy as np

from splitserve.state import StateKind, checksum
from splitserve.state.client import StateStoreClient
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

_keys = itertools.count()
TRANSPORTS = ("shm", "shm+scatter", "gRPC", "mooncake")


def serve_store(memory_bytes: int, transfer_engine: str, address_out: Connection, stop: Event) -> None:
    """A store in its own process, as on a node (its Ray actor): sends its address (or the error
    that kept its transfer engine from starting), serves until `stop`."""
    try:
        store = StateStore.from_config(
            StoreConfig(memory_bytes=memory_bytes, transfer_engine=transfer_engine)
        )
        server = StateStoreServer(store)
    except ImportError as e:
        address_out.send(e)
        return
    address_out.send(server.address)
    stop.wait()
    server.stop(grace_s=0)
    store.close()


def read_keys(address: str, use_mooncake: bool, jobs: Connection) -> None:
    """The reader's process (a decode worker): per (key, transport, num_bytes) job, opens a Get
    waiting on the key, says "ready", takes every chunk (verified by the client, and scattered
    into one array unless the transport is `shm`), says ("done", num_bytes, when), then sends the
    checksum of what it scattered (untimed: the writer checks it)."""
    transport = None
    if use_mooncake:
        from splitserve.state.transport import open_client

        transport = open_client("mooncake", "127.0.0.1")
    client = StateStoreClient(address, timeout_s=300)
    out = np.empty(0, np.uint8)
    while (job := jobs.recv()) is not None:
        key, kind, num_bytes = job
        if out.nbytes < num_bytes:
            out = np.zeros(num_bytes, np.uint8)  # touched once, warm for every repeat: as a cache
        shm = kind.startswith("shm")
        stream = client.get(
            key,
            timeout_s=300,
            wait_for_key=True,
            shared_memory=shm,
            transport=transport if kind == "mooncake" else None,
        )
        jobs.send("ready")
        start = 0
        for chunk in stream:
            end = start + chunk.meta.num_bytes
            if kind != "shm":
                out[start:end] = np.frombuffer(chunk.data, np.uint8)
            start = end
        done_at = time.perf_counter()  # CLOCK_MONOTONIC: the writer's clock too
        jobs.send(("done", start, done_at))
        jobs.send(checksum.compute(out[:num_bytes].data) if kind != "shm" else None)
    client.close()


def layer_pieces(mib: int, piece_mib: float) -> list[np.ndarray]:
    """`mib` MiB of fp32 state (seeded by the size) in pieces of about `piece_mib` MiB (rows of 128)."""
    data = np.random.default_rng(mib).standard_normal(mib << 18).astype(np.float32)
    rows = max(128, int(piece_mib * (1 << 18)) // 128 * 128)
    return [data[i : i + rows].reshape(-1, 128) for i in range(0, len(data), rows)]


def put_pieces(client: StateStoreClient, key: str, pieces: list[np.ndarray], shared_memory: bool) -> None:
    """Puts `pieces` under `key` as a prefill does (one `write_state` per layer, then `finish`)."""
    num_bytes = sum(p.nbytes for p in pieces)
    put = client.open_put(key, owner="bench", shared_memory=shared_memory, expected_bytes=num_bytes)
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


def handoff(client: StateStoreClient, reader: Connection, pieces: list[np.ndarray], kind: str) -> float:
    """One request's handoff over `kind`; seconds from the writer's `open_put` until the reader
    held every piece. Releases the key afterwards (untimed, as a decode does after use)."""
    key = f"bench-{next(_keys)}"
    num_bytes = sum(p.nbytes for p in pieces)
    reader.send((key, kind, num_bytes))
    assert reader.recv() == "ready"
    start = time.perf_counter()
    put_pieces(client, key, pieces, shared_memory=kind != "gRPC")
    done, received, done_at = reader.recv()
    elapsed_s = done_at - start  # until the reader held it all, not until the writer heard so
    scattered = reader.recv()
    assert done == "done" and received == num_bytes, (done, received, num_bytes)
    whole = np.concatenate([p.reshape(-1) for p in pieces]).view(np.uint8)
    assert scattered is None or scattered == checksum.compute(whole.data), (
        f"{kind}: the reader's copy differs"
    )
    client.release(key)
    return elapsed_s


def measure(
    client: StateStoreClient, reader: Connection, mib: int, piece_mib: float, repeats: int, kinds: list[str]
) -> list[float | None]:
    """GB/s of memcpy, then of each of TRANSPORTS (None: not run) for `mib` MiB."""
    pieces = layer_pieces(mib, piece_mib)
    data = np.concatenate([p.reshape(-1) for p in pieces])
    out = np.empty_like(data)
    copy_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(out, data)
        copy_s = min(copy_s, time.perf_counter() - start)
    rates: list[float | None] = [data.nbytes / copy_s / 1e9]
    for kind in TRANSPORTS:
        if kind in kinds:
            best_s = min(handoff(client, reader, pieces, kind) for _ in range(repeats))
            rates.append(data.nbytes / best_s / 1e9)
        else:
            rates.append(None)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--piece-mib", type=float, default=2.0)
    parser.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    parser.add_argument(
        "--no-spare-region",
        action="store_true",
        help="the writer allocates each put's region when it opens the put (no region leased ahead)",
    )
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    stop = context.Event()
    memory_bytes = 3 * max(args.sizes_mib) << 20
    engine = "mooncake" if "mooncake" in args.transports else "none"
    store_process = context.Process(target=serve_store, args=(memory_bytes, engine, send, stop))
    store_process.start()
    address = receive.recv()
    if isinstance(address, ImportError):  # no mooncake here: run the others, say why
        print(f"mooncake: n/a ({address})")
        args.transports.remove("mooncake")
        store_process.join()
        store_process = context.Process(target=serve_store, args=(memory_bytes, "none", send, stop))
        store_process.start()
        address = receive.recv()
    jobs, reader_end = context.Pipe()
    reader_process = context.Process(
        target=read_keys, args=(address, "mooncake" in args.transports, reader_end)
    )
    reader_process.start()
    client = StateStoreClient(address, timeout_s=300, spare_region=not args.no_spare_region)
    assert client.local_arena() is not None, "no shared-memory arena: is /dev/shm there?"
    print(f"{'size':>8} {'memcpy':>7}" + "".join(f" {kind:>11} {'':>5}" for kind in TRANSPORTS) + "  GB/s")
    try:
        for mib in args.sizes_mib:
            copy, *rates = measure(client, jobs, mib, args.piece_mib, args.repeats, args.transports)
            assert copy is not None
            cells = "".join(
                f" {rate:11.2f} {rate / copy:5.0%}" if rate is not None else f" {'n/a':>11} {'':>5}"
                for rate in rates
            )
            print(f"{mib:>5} MiB {copy:7.2f}{cells}")
    finally:
        jobs.send(None)
        reader_process.join(30)
        client.close()
        stop.set()
        store_process.join(30)


if __name__ == "__main__":
    main()
