"""Experiment: a request's state across two raylets, one hop vs two hops, against memcpy.

    python -m experiments.cross_node_transfer [--sizes-mib 1 16 64 256] [--repeats 3] [--piece-mib 2]

A `ray.cluster_utils.Cluster` with two raylets on this machine (nodes A and B), a real state
store on each (an actor pinned to its node, serving gRPC on 127.0.0.1), a writer actor on A
(the prefill) and a reader actor on B (the decode). For each size, a fp32 state in layer-sized
pieces (default 2 MiB: one Kimi-Linear-48B KDA layer) goes from the writer to the reader:

* `one-hop` (the default path): the writer puts it into A's store through its shared-memory
  arena (a prefill writing to its own node's store), the reader on B streams it from A's store
  as gRPC bytes (a decode reading another node's store);
* `two-hop` (the path before): the writer streams the bytes to B's store over gRPC, the reader
  reads them from its own node's store through the arena;
* `mooncake`: one hop with the reader pulling A's arena regions through Mooncake Transfer Engine
  (TCP on loopback); n/a where the extra or libibverbs is missing.

Both raylets share this machine, so "across nodes" is loopback TCP: what differs from a real
network is bandwidth and latency, not the number of copies, hops or checksum passes. As in a
handoff the reader's Get waits on the key before the writer starts; a transfer is timed from
the writer's first piece to the reader holding every chunk, checksums verified and each chunk
copied into one array (the scatter into a cache). Prints best-of-`repeats` GB/s and the share
of a memcpy of the same bytes in the reader's process. Figures only.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster

from experiments.state_transfer import layer_pieces, put_pieces
from splitserve.state.client import StateStoreClient
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

PATHS = ("one-hop", "two-hop", "mooncake")
_keys = itertools.count()


class StoreNode:
    """One node's store and its gRPC server (a Ray actor pinned to the node)."""

    def __init__(self, memory_bytes: int, transfer_engine: str) -> None:
        self.store = StateStore.from_config(
            StoreConfig(memory_bytes=memory_bytes, transfer_engine=transfer_engine)
        )
        self.server = StateStoreServer(self.store, "127.0.0.1", 0)

    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.server.stop(grace_s=0)
        self.store.close()


class Writer:
    """The prefill's side on node A: puts a state in layer-sized pieces into a store."""

    def __init__(self) -> None:
        self._clients: dict[str, StateStoreClient] = {}
        self._pieces: dict[tuple[int, float], list[np.ndarray]] = {}

    def write(self, address: str, key: str, mib: int, piece_mib: float, shared_memory: bool) -> float:
        """Puts `mib` MiB under `key` (arena or bytes); returns the wall time it started."""
        client = self._clients.setdefault(address, StateStoreClient(address, timeout_s=300))
        if (mib, piece_mib) not in self._pieces:
            self._pieces = {(mib, piece_mib): layer_pieces(mib, piece_mib)}
        start = time.time()
        put_pieces(client, key, self._pieces[(mib, piece_mib)], shared_memory)
        return start

    def release(self, address: str, key: str) -> None:
        self._clients[address].release(key)


class Reader:
    """The decode's side on node B: one Get waiting on a key, then every chunk copied out."""

    def __init__(self, use_mooncake: bool) -> None:
        self._clients: dict[str, StateStoreClient] = {}
        self._transport: Any = None
        if use_mooncake:
            from splitserve.state.transport import open_client

            self._transport = open_client("mooncake", "127.0.0.1")
        self._out = np.empty(0, np.uint8)
        self._stream: Any = None

    def open(self, address: str, key: str, shared_memory: bool, mooncake: bool, num_bytes: int) -> None:
        client = self._clients.setdefault(address, StateStoreClient(address, timeout_s=300))
        if self._out.nbytes < num_bytes:
            self._out = np.zeros(num_bytes, np.uint8)  # touched once, warm for every repeat: a cache
        transport = self._transport if mooncake else None
        self._stream = client.get(
            key, timeout_s=300, wait_for_key=True, shared_memory=shared_memory, transport=transport
        )

    def drain(self) -> tuple[float, int]:
        """Takes every chunk (verified by the client) into one array; (wall time done, bytes)."""
        start = 0
        for chunk in self._stream:
            end = start + chunk.meta.num_bytes
            self._out[start:end] = np.frombuffer(chunk.data, np.uint8)
            start = end
        return time.time(), start

    def memcpy_s(self, num_bytes: int, repeats: int) -> float:
        data = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
        out = np.empty_like(data)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            np.copyto(out, data)
            best = min(best, time.perf_counter() - start)
        return best


def transfer(
    writer: Any, reader: Any, stores: dict[str, str], path: str, mib: int, piece_mib: float
) -> float:
    """One handoff over `path`; seconds from the writer's first piece to the reader holding all."""
    key = f"bench-{next(_keys)}"
    target = stores["b"] if path == "two-hop" else stores["a"]
    # two hops: bytes into B's store, then B's arena; one hop: A's arena, then bytes (or mooncake)
    ray.get(reader.open.remote(target, key, path == "two-hop", path == "mooncake", mib << 20))
    done = reader.drain.remote()
    started = ray.get(writer.write.remote(target, key, mib, piece_mib, path != "two-hop"))
    finished, num_bytes = ray.get(done)
    assert num_bytes == mib << 20, (path, num_bytes)
    ray.get(writer.release.remote(target, key))
    return float(finished - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--piece-mib", type=float, default=2.0)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    args = parser.parse_args()
    # Our own RAY_TMPDIR: a Cluster advertises itself there, and other Ray users on this machine
    # must not join it (nor we theirs).
    temp_dir = tempfile.mkdtemp(prefix="ssxn-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_dir
    os.environ.pop("RAY_ADDRESS", None)
    head = {"num_cpus": 2, "resources": {"node_a": 4}, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**head, "dashboard_agent_listen_port": None})
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 4})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        run(args)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    memory_bytes = 3 * max(args.sizes_mib) << 20
    engine = "mooncake" if "mooncake" in args.paths else "none"
    on_a, on_b = {"num_cpus": 0, "resources": {"node_a": 1}}, {"num_cpus": 0, "resources": {"node_b": 1}}
    store_cls: Any = ray.remote(StoreNode)
    nodes: dict[str, Any]
    try:
        nodes = {"a": store_cls.options(**on_a).remote(memory_bytes, engine)}
        ray.get(nodes["a"].address.remote())
    except ray.exceptions.RayActorError as exc:  # no mooncake here: run the others, say why
        print(f"mooncake: n/a ({exc})")
        args.paths.remove("mooncake")
        engine = "none"
        nodes = {"a": store_cls.options(**on_a).remote(memory_bytes, engine)}
    nodes["b"] = store_cls.options(**on_b).remote(memory_bytes, engine)
    stores: dict[str, str] = {name: ray.get(node.address.remote()) for name, node in nodes.items()}
    writer: Any = ray.remote(Writer).options(**on_a).remote()
    reader: Any = ray.remote(Reader).options(**on_b).remote("mooncake" in args.paths)
    print(f"{'size':>8} {'memcpy':>7}" + "".join(f" {path:>9} {'':>5}" for path in PATHS) + "  GB/s")
    try:
        for mib in args.sizes_mib:
            copy = (mib << 20) / ray.get(reader.memcpy_s.remote(mib << 20, args.repeats)) / 1e9
            cells = ""
            for path in PATHS:
                if path not in args.paths:
                    cells += f" {'n/a':>9} {'':>5}"
                    continue
                best_s = min(
                    transfer(writer, reader, stores, path, mib, args.piece_mib) for _ in range(args.repeats)
                )
                rate = (mib << 20) / best_s / 1e9
                cells += f" {rate:9.2f} {rate / copy:5.0%}"
            print(f"{mib:>5} MiB {copy:7.2f}{cells}", flush=True)
    finally:
        ray.get([node.stop.remote() for node in nodes.values()])


if __name__ == "__main__":
    main()
