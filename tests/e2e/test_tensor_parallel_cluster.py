"""Tensor parallelism in a real deployment (local Ray, real actors, gRPC, HTTP, the official openai
client): a prefill pool at tensor_parallel 2 handing off to a decode pool at 1, the reverse, and both at
2 with the prefill's experts spread over its ranks (expert_parallel), give the offline engine's greedy
tokens, each decode rank reading its heads of the state from the store; a conversation's next turn
is served from the turn the decode worker published at its width to a prefill at the other width
(the cluster prefix cache across widths); ranks 1..N-1 running as Ray
actors in their own bundles of the replica's placement group; and a decode rank's actor SIGKILLed
mid-stream makes its worker unhealthy: the controller restarts the worker whole (a new rank actor in
the same bundle) and its streams resume from the ReplaySSM state its ranks stored, ending with the
uninterrupted tokens."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from deploy.launcher import run_cluster
from splitserve import LLM, SamplingParams
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.state.client import StateStoreClient
from splitserve.tiny_model import make_tiny_model
from tests.e2e.helpers import MODEL, assert_idle, cluster_config, complete, openai_client, worker_stats
from tests.e2e.test_decode_failover import (
    GREEDY,
    NUM_BEFORE_KILL_STORED,
    NUM_TOKENS,
    REPLAY_WINDOW,
    Streams,
    _failovers,
)

NUM_NEW_TOKENS = 8
UNIT = 16  # cache.prefix_unit: a turn's reply of 24 tokens beats the prefill's own hit by a unit
REPLY_TOKENS = 24
WAIT_S = 60.0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp-e2e-model"), seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(26)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in (1, 9, 40, 130)]


@pytest.fixture(scope="module")
def offline_tokens(model_path, prompts):
    llm = LLM(model=str(model_path), max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def _serve(cluster, prompts):
    client = openai_client(cluster.gateway_url)
    params = {"max_tokens": NUM_NEW_TOKENS, "temperature": 0.0}
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(client, p, params), prompts))


def _config(
    model_path, prefill_tp: int, decode_tp: int, expert_parallel: bool = False, replay_window: int = 0
):
    pools = {"num_cpus": 0.5, "kv_cache_memory_bytes": "32MiB", "max_num_seqs": 8}
    return cluster_config(
        model_path,
        "disaggregated",
        prefill={**pools, "tensor_parallel": prefill_tp, "expert_parallel": expert_parallel},
        decode={**pools, "tensor_parallel": decode_tp, "replay_window": replay_window},
        cache={"prefix_unit": UNIT},
    )


@pytest.mark.parametrize("prefill_tp,decode_tp,expert_parallel", [(2, 1, False), (1, 2, False), (2, 2, True)])
def test_tensor_parallel_pools_serve_the_offline_tokens(
    local_ray, model_path, prompts, offline_tokens, prefill_tp, decode_tp, expert_parallel
):
    kill_test = decode_tp == 2 and not expert_parallel  # once is enough
    # there the decode ranks keep stored state (ReplaySSM pieces, each rank's heads): the failover resumes from it
    replay_window = REPLAY_WINDOW if kill_test else 0
    with run_cluster(_config(model_path, prefill_tp, decode_tp, expert_parallel, replay_window)) as cluster:
        pools = cluster.status()["pools"]
        assert (pools["prefill"]["tensor_parallel"], pools["decode"]["tensor_parallel"]) == (
            prefill_tp,
            decode_tp,
        )
        for name, size in (("prefill", prefill_tp), ("decode", decode_tp)):
            _ranks_are_actors_in_the_replicas_bundles(cluster, name, size)
        assert _serve(cluster, prompts) == offline_tokens
        assert_idle(cluster)
        # every decode rank read its heads from the store itself: rank 0 forwarded no piece
        assert worker_stats(cluster, "decode", 0)["rank_forwarded_pieces"] == 0
        if prefill_tp != decode_tp:
            _the_next_turn_hits_the_store_across_widths(cluster, prompts[2], model_path)
        if kill_test:
            _a_killed_rank_restarts_its_worker_whole(cluster, prompts, model_path)


def _the_next_turn_hits_the_store_across_widths(cluster, first: list[int], model_path) -> None:
    """Turn 1 ends on the decode worker, which publishes prompt + reply to the store at its width;
    turn 2 re-sends them and goes on: the prefill worker, at the other width, streams that state in
    (its own cache holds only turn 1's prompt) and gives the offline engine's tokens."""
    client = openai_client(cluster.gateway_url)
    params = {"max_tokens": REPLY_TOKENS, "temperature": 0.0}
    reply = complete(client, first, params)
    second = first + reply + [5, 6, 7]
    chain = prefix_hash_chain(second, UNIT, MODEL.encode())  # the gateway's salt: the served name
    turn_1 = len(first) + len(reply) - 1  # every token turn 1 computed (its last sample was not)
    with StateStoreClient(cluster.status()["stores"][0]["address"]) as store:
        deadline = time.monotonic() + WAIT_S
        while store.match_prefix(chain, second[:-1]).num_tokens < turn_1:  # the publish is async
            assert time.monotonic() < deadline, "the decode worker's finished turn never reached the store"
            time.sleep(0.1)
    assert worker_stats(cluster, "decode", 0)["prefix_published"] > 0
    before = worker_stats(cluster, "prefill", 0)
    got = complete(client, second, params)
    llm = LLM(model=str(model_path), max_model_len=4096)
    greedy = SamplingParams(temperature=0.0, max_tokens=REPLY_TOKENS, ignore_eos=True)
    assert got == llm.generate(prompt_token_ids=[second], sampling_params=greedy)[0].outputs[0].token_ids
    after = worker_stats(cluster, "prefill", 0)
    assert after["prefix_store_hits"] == before["prefix_store_hits"] + 1
    hit_tokens = after["prefix_store_hit_tokens"] - before["prefix_store_hit_tokens"]
    assert hit_tokens == turn_1
    print(f"store hit across widths: {hit_tokens} of {len(second)} prompt tokens served from the store")


def _placement_group_id(_self) -> str:
    return ray.get_runtime_context().get_placement_group_id()


def _ranks_are_actors_in_the_replicas_bundles(cluster, pool: str, size: int) -> None:
    """The worker (rank 0) sits in bundle 0 of its replica's placement group and ranks 1..N-1 are Ray
    actors in bundles 1..N-1 of the same group, as the ranks, Ray's books and the OS all say."""
    handle = ray.get(cluster.controller.worker_handle.remote(pool, 0), timeout=30)
    group_id = ray.get(handle.__ray_call__.remote(_placement_group_id), timeout=30)
    stats = ray.get(handle.stats.remote(), timeout=30)
    ranks = stats["ranks"]
    assert [r["rank"] for r in ranks] == list(range(1, size))
    assert stats["rank_pids"] == [r["pid"] for r in ranks]
    placed = [(r["placement_group_id"], r["bundle_index"]) for r in ranks]
    assert placed == [(group_id, i) for i in range(1, size)]
    # each bundle of the replica is taken whole, by rank 0 or a rank actor
    bundles = [f"CPU_group_{i}_{group_id}" for i in range(size)]
    assert all(ray.cluster_resources().get(b, 0.0) > 0 for b in bundles)
    free = ray.available_resources()
    assert [free.get(b, 0.0) for b in bundles] == [0.0] * size, free
    for rank in ranks:  # Ray names an actor's process after its class and running method
        with open(f"/proc/{rank['pid']}/cmdline", "rb") as f:
            assert f.read().startswith(b"ray::RankActor"), rank


def _a_killed_rank_restarts_its_worker_whole(cluster, prompts, model_path):
    """SIGKILL of the decode worker's rank while 4 greedy streams run on it: the worker restarts whole
    (a new rank process), and the streams fail over onto it from the state the worker's ranks stored
    (the lost worker's engine died: it kept that state) and end with the uninterrupted tokens."""
    url = cluster.gateway_url
    stored_before = _failovers(url, "resumed", "stored_state")
    reprefilled_before = _failovers(url, "resumed", "reprefill")
    (rank_pid,) = worker_stats(cluster, "decode", 0)["rank_pids"]
    streams = Streams(url, prompts, GREEDY)
    streams.wait_until_all_have(NUM_BEFORE_KILL_STORED)  # past a window: pieces stored, none has ended
    os.kill(rank_pid, signal.SIGKILL)
    results = streams.finish()
    assert not [s.error for s in results if s.error]
    llm = LLM(model=str(model_path), max_model_len=4096)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert [s.token_ids for s in results] == expected
    # the kill landed on running streams, each resumed from what the TP worker stored (a resume
    # tried while the worker restarts counts as failed: no worker answered yet, it is tried again)
    assert _failovers(url, "resumed", "stored_state") == stored_before + len(prompts)
    assert _failovers(url, "resumed", "reprefill") == reprefilled_before
    decode = cluster.status()["pools"]["decode"]
    assert decode["restarts"] == 1 and decode["healthy"], decode
    (new_pid,) = worker_stats(cluster, "decode", 0)["rank_pids"]
    assert new_pid != rank_pid
    _ranks_are_actors_in_the_replicas_bundles(cluster, "decode", 2)  # the new rank in the same bundle
    assert_idle(cluster)
