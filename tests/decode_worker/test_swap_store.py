"""The store as the swap space: a decode engine swapping preempted requests out to a real store
server (shared-memory arena or bytes over gRPC) gives the tokens of an engine that never
preempts, and leaves no key behind; a store that fails a put or loses a state costs a recompute
(same tokens), never the request. A decode worker in swap mode wires its node's store in."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_worker.actor import DecodeWorkerActor
from decode_worker.swap_space import StoreSwapSpace
from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM
from splitserve.engine.cache_spec import CachePlan
from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine.state_transfer import LayerState
from splitserve.engine.swap_space import SwapStats
from splitserve.engine_config import EngineConfig
from splitserve.state.client import StateStoreClient
from splitserve.tiny_model import make_tiny_model
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore
from tests.engine.test_swap import (
    BLOCK_SIZE,
    MAX_NUM_SEQS,
    NUM_NEW_TOKENS,
    PROMPT_LENGTHS,
    _greedy,
    _seeded,
    _tight,
)
from tests.workers.client import generate, reserve

OWNER = "decode-swap-test"


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="module")
def prompts(tiny_model_path) -> list[list[int]]:
    vocab = KimiLinearModelConfig.from_pretrained(tiny_model_path).vocab_size
    rng = random.Random(15)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["arena", "grpc"])
def store(request) -> Iterator[tuple[StateStore, str]]:
    arena = {} if request.param == "arena" else {"arena_root": None}
    made = StateStore.from_config(StoreConfig(memory_bytes=64 << 20, **arena))
    server = StateStoreServer(made, "127.0.0.1", 0)
    yield made, server.address
    server.stop(grace_s=0)
    made.close()


@pytest.fixture(scope="module")
def unpreempted(tiny_model_path, prompts) -> dict[str, list[list[int]]]:
    llm = LLM(model=str(tiny_model_path), dtype="float32", num_threads=1, max_model_len=512)
    return {
        name: [
            list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=p)
        ]
        for name, p in (("greedy", _greedy()), ("seeded", _seeded()))
    }


class LosingStore(StoreSwapSpace):
    """The store loses every other state before it is read back (evicted, expired, restarted)."""

    num_lost = 0

    def take(self, request_id: str) -> list[LayerState] | None:
        key = self._keys.get(request_id)
        if key is not None and self.stats.num_takes + self.stats.num_take_failures < 2 * self.num_lost + 1:
            self.client.release(key)
            self.num_lost += 1
        return super().take(request_id)


def _swap_llm(path, space: StoreSwapSpace) -> LLM:
    llm = LLM(model=str(path), dtype="float32", num_threads=1, **_tight(path, preemption_mode="swap"))
    llm.engine.set_swap_space(space)
    return llm


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [
        list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]


def _swap_through(
    path, prompts, address: str, params, space_type: type[StoreSwapSpace] = StoreSwapSpace
) -> tuple[StoreSwapSpace, SwapStats, list[list[int]]]:
    """Generate on a tight swap-mode engine whose swap space is the store at `address`."""
    with StateStoreClient(address) as client:
        space = space_type(client, OWNER)
        llm = _swap_llm(path, space)
        return space, llm.engine.swap_stats(), _generate(llm, prompts, params)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_swapping_through_the_store_gives_the_unpreempted_tokens(
    tiny_model_path, prompts, unpreempted, store, kind
):
    stored, address = store
    params = _greedy() if kind == "greedy" else _seeded()
    space, stats, tokens = _swap_through(tiny_model_path, prompts, address, params)
    assert stats.num_swapped_out > 0 and stats.num_recompute_fallbacks == 0
    assert space.stats.num_puts == space.stats.num_takes == stats.num_swapped_in == stats.num_swapped_out
    assert space.stats.num_bytes == stats.num_swap_out_bytes
    assert tokens == unpreempted[kind]
    assert stored.stats().num_keys == 0  # every swapped state was released once read back


def test_a_state_the_store_lost_is_recomputed_with_the_same_tokens(
    tiny_model_path, prompts, unpreempted, store
):
    stored, address = store
    space, stats, tokens = _swap_through(tiny_model_path, prompts, address, _seeded(), LosingStore)
    assert isinstance(space, LosingStore) and space.num_lost > 0
    assert space.stats.num_take_failures == stats.num_recompute_fallbacks == space.num_lost
    assert tokens == unpreempted["seeded"]
    assert stored.stats().num_keys == 0


def test_a_store_that_refuses_puts_costs_a_recompute(tiny_model_path, prompts, unpreempted):
    with StateStoreClient("127.0.0.1:1", timeout_s=2.0) as client:  # nothing listens there
        space = StoreSwapSpace(client, OWNER, timeout_s=2.0)
        llm = _swap_llm(tiny_model_path, space)
        tokens = _generate(llm, prompts, _greedy())
        stats = llm.engine.swap_stats()
        assert stats.num_swapped_out == 0 and stats.num_recompute_fallbacks > 0
        assert space.stats.num_put_failures == stats.num_recompute_fallbacks
        assert tokens == unpreempted["greedy"]


def test_a_decode_worker_in_swap_mode_swaps_to_its_store(tiny_model_path, store):
    _, address = store
    config = EngineConfig(model=str(tiny_model_path), max_model_len=256, preemption_mode="swap")
    worker = DecodeWorkerActor(config, address)
    worker.start("127.0.0.1", 0)
    try:
        assert isinstance(worker.swap_space, StoreSwapSpace)
        assert worker.loop.call(lambda e: e.swapper.space).result() is worker.swap_space
        stats = worker.stats()
        assert stats["swap_store"] == dataclasses.asdict(worker.swap_space.stats)
        assert stats["swap_num_swapped_out"] == 0 and "swap_num_recompute_fallbacks" in stats
    finally:
        worker.shutdown()
    plain = DecodeWorkerActor(dataclasses.replace(config, preemption_mode="recompute"), address)
    plain.start("127.0.0.1", 0)
    try:
        assert plain.swap_space is None and "swap_store" not in plain.stats()
    finally:
        plain.shutdown()


def test_a_decode_worker_swaps_preempted_streams_through_its_store(
    tiny_model_path, prompts, unpreempted, store
):
    """The Reserve -> Prefill -> Decode flow over gRPC, on a decode worker whose KV budget holds
    every prompt but a quarter of the replies: its streams preempt each other, swap to the store
    and back, and stream the tokens of an engine that never preempts."""
    _, address = store
    unit = CachePlan.specs(
        KimiLinearModelConfig.from_pretrained(tiny_model_path), block_size=BLOCK_SIZE, dtype="float32"
    )
    num_blocks = sum(-(-(n + 1) // BLOCK_SIZE) for n in PROMPT_LENGTHS)
    num_blocks += len(PROMPT_LENGTHS) * NUM_NEW_TOKENS // 4 // BLOCK_SIZE
    base = EngineConfig(model=str(tiny_model_path), max_model_len=128, num_threads=1)
    decode_config = dataclasses.replace(
        base,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS,
        kv_cache_memory_bytes=MAX_NUM_SEQS * unit.slot_room_bytes + num_blocks * unit.block_bytes,
        preemption_mode="swap",
    )
    workers = [PrefillWorkerActor(base, address), DecodeWorkerActor(decode_config, address)]
    prefill, decode = (w.start("127.0.0.1", 0) for w in workers)
    try:
        rooms = [reserve(decode, f"swap-{i}", p) for i, p in enumerate(prompts)]  # every prompt fits
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda i: generate(prefill, decode, f"swap-{i}", prompts[i], _greedy(), rooms[i]),
                    range(len(prompts)),
                )
            )
        assert [r.token_ids for r in results] == unpreempted["greedy"]
        stats = workers[1].stats()
        assert stats["swap_num_swapped_out"] > 0, "the decode worker's KV budget was meant to force swaps"
        assert (
            stats["swap_num_swapped_in"] == stats["swap_num_swapped_out"] == stats["swap_store"]["num_puts"]
        )
        assert stats["swap_num_recompute_fallbacks"] == 0
    finally:
        for worker in workers:
            worker.shutdown()
