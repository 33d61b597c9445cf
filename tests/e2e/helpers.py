"""Driving and inspecting a running deployment from a test: the official openai client, token ids
from its responses, and what the workers and stores still hold once requests are done.

The numbers are read at their source (each worker actor's `stats()`, each store's Stats RPC),
not from the controller's status, so these checks do not trust what they check.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import ray

from splitserve.rpc import make_channel
from splitserve.v1 import store_pb2, store_pb2_grpc

MODEL = "tiny"
TOKEN_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


def cluster_config(model_path: Any, mode: str, max_num_seqs: int = 8, **sections: Any) -> Any:
    """A one-node deployment of the tiny model: one prefill and one decode worker, or (colocated)
    one worker doing both; the tests' small pools, a memory-only store, and `sections` on top."""
    from splitserve.config import parse_config

    pools = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": max_num_seqs}
    data = {
        "model": {"path": str(model_path), "name": MODEL},
        "mode": mode,
        "gateway": {"port": 0},
        "store": {"memory_bytes": "128MiB", "disk": {"path": None}},
        "health": {"interval_s": 1, "timeout_s": 30, "start_timeout_s": 300},
        "prefill": pools,
        "decode": pools if mode == "disaggregated" else {"replicas": 0},
        **sections,
    }
    return parse_config(data)


def openai_client(gateway_url: str | None) -> openai.OpenAI:
    assert gateway_url, "the deployment has no gateway URL"
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)


def token_id(token: str) -> int:
    """A logprobs token rendered with `return_tokens_as_token_ids` ("token_id:N") as N."""
    return int(token.removeprefix("token_id:"))


def token_ids(choice: Any) -> list[int]:
    return [token_id(t) for t in choice.logprobs.tokens]


def complete(client: openai.OpenAI, prompt: list[int], params: dict[str, Any]) -> list[int]:
    """One completion (EOS ignored, so its length is max_tokens); its token ids."""
    out = client.completions.create(model=MODEL, prompt=prompt, logprobs=0, extra_body=TOKEN_IDS, **params)
    return token_ids(out.choices[0])


def store_contents(address: str) -> tuple[int, int]:
    """(keys, bytes) of request state one store holds now, from its StateStore.Stats RPC.

    Retained prefixes (the cluster's prefix cache) stay on purpose after the requests that made
    them end, so they are not counted: anything else left is a leak.
    """
    with make_channel(address) as channel:
        stats = store_pb2_grpc.StateStoreStub(channel).Stats(store_pb2.StatsRequest(), timeout=30)
    num_bytes = sum(tier.num_bytes for tier in stats.tiers)
    return stats.num_keys - stats.num_prefix_keys, num_bytes - stats.num_prefix_bytes


def worker_stats(cluster: Any, pool: str, index: int) -> dict[str, Any]:
    """One worker's own `stats()`, through the handle its controller holds."""
    handle = ray.get(cluster.controller.worker_handle.remote(pool, index), timeout=30)
    assert handle is not None, f"{pool} worker {index} is down"
    return ray.get(handle.stats.remote(), timeout=30)  # type: ignore[no-any-return]


def still_held(cluster: Any) -> list[str]:
    """What the deployment still holds, one line per worker or store that is not empty (or that
    reports no capacity at all, which would make "every block is free" vacuous)."""
    status = cluster.status()
    held = [f"pool {name} unhealthy: {pool}" for name, pool in status["pools"].items() if not pool["healthy"]]
    for name, pool in status["pools"].items():
        for row in pool["workers"]:
            stats = worker_stats(cluster, name, row["index"])
            where = f"{name} worker {row['index']}"
            if not (stats["num_total_kv_blocks"] and stats["num_total_state_slots"]):
                held.append(f"{where} reports no KV blocks or state slots: {stats}")
            busy = {k: stats[k] for k in ("num_running", "num_waiting", "num_reserved") if stats[k]}
            if stats["num_free_kv_blocks"] != stats["num_total_kv_blocks"]:
                busy["kv_blocks_in_use"] = stats["num_total_kv_blocks"] - stats["num_free_kv_blocks"]
            if stats["num_free_state_slots"] != stats["num_total_state_slots"]:
                busy["state_slots_in_use"] = stats["num_total_state_slots"] - stats["num_free_state_slots"]
            if busy:
                held.append(f"{where}: {busy}")
    for store in status["stores"]:
        num_keys, num_bytes = store_contents(store["address"])
        if num_keys or num_bytes:
            held.append(f"store at {store['address']}: {num_keys} keys, {num_bytes} bytes")
    return held


def assert_idle(cluster: Any, *, timeout_s: float = 10.0) -> None:
    """Every worker idle with all its blocks and slots free, every store empty, within `timeout_s`.

    Releases trail the last response a little (a decode frees its blocks after the final token is
    sent), so this polls the condition; a leak never clears and fails with what is held.
    """
    status = cluster.status()
    assert any(pool["workers"] for pool in status["pools"].values()), f"no workers to check: {status}"
    assert status["stores"], f"no stores to check: {status}"
    deadline_s = time.monotonic() + timeout_s
    while (held := still_held(cluster)) and time.monotonic() < deadline_s:
        time.sleep(0.2)
    assert not held, f"still held {timeout_s:g} s after the last response: {held}"
