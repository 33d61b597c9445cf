"""Benchmark: state-store transfer throughput against a plain memcpy of the same bytes.

    python -m experiments.state_transfer [--sizes-mib 1 16 64] [--repeats 3]

For each size it streams a fp32 tensor as the prefill worker does (state_codec.encode into 1 MiB
crc32 chunks, through `StateStoreClient.open_put`) into a real StateStore gRPC server on
127.0.0.1, gets it back as the decode worker does (`get`; checksums verified by the store and
by the client) and decodes the tensor; next to it, `torch.clone` of the same tensor. Prints
GB/s for put, get, the round trip, and memcpy, and the ratio. Figures only.
"""

from __future__ import annotations

import argparse
import time

import torch

from splitserve.engine.state_codec import decode, encode
from splitserve.engine.state_transfer import LayerState
from splitserve.state import StateKind
from splitserve.state.client import StateStoreClient
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore


def _best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(client: StateStoreClient, mib: int, repeats: int) -> tuple[float, float, float, int]:
    """Best-of-`repeats` seconds for put, get and memcpy of `mib` MiB, and the byte count."""
    tensor = torch.randn(mib << 18)  # mib MiB of fp32
    rows = tensor.view(-1, 256)
    state = LayerState(0, StateKind.MLA_KV, rows, 0, rows.shape[0])
    keys: list[str] = []

    def put() -> None:
        key = f"bench-{mib}-{len(keys)}"
        keys.append(key)
        stream = client.open_put(key, owner="bench")
        stream.write(encode(state, key))
        stream.finish(timeout_s=120)

    def get() -> None:
        (out,) = decode(client.get(keys[-1], timeout_s=60))
        assert out.tensor.shape == rows.shape

    put_s, get_s = _best(put, repeats), _best(get, repeats)
    copy_s = _best(tensor.clone, repeats)
    for key in keys:
        client.release(key)
    return put_s, get_s, copy_s, tensor.numel() * 4


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    store = StateStore.from_config(StoreConfig(memory_bytes=4 * max(args.sizes_mib) << 20))
    server = StateStoreServer(store)
    client = StateStoreClient(server.address)
    print(
        f"{'size':>8} {'put GB/s':>9} {'get GB/s':>9} {'round trip':>11} {'memcpy GB/s':>12} {'memcpy/rt':>10}"
    )
    try:
        for mib in args.sizes_mib:
            put_s, get_s, copy_s, num_bytes = measure(client, mib, args.repeats)
            put_gbps, get_gbps, copy_gbps = (num_bytes / t / 1e9 for t in (put_s, get_s, copy_s))
            rt = num_bytes / (put_s + get_s) / 1e9
            print(
                f"{mib:>5} MiB {put_gbps:9.2f} {get_gbps:9.2f} {rt:11.2f} {copy_gbps:12.2f} {copy_gbps / rt:9.1f}x"
            )
    finally:
        client.close()
        server.stop(grace_s=0)
        store.close()


if __name__ == "__main__":
    main()
