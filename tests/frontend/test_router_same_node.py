"""Same-node preference: a decode worker on the chosen prefill worker's node (the same store) is
tried first while its load allows, so the state never leaves the node; past the margin, or
without store knowledge, ranking is by load alone. The gateway reserves with the prefill's store."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.prefix_router import PrefixAwareRouter
from frontend.router import SAME_NODE_MARGIN, DecodeLoad, LeastLoadRouter, RoundRobinRouter
from tests.frontend.conftest import MODEL, running_gateway
from tests.frontend.fakes import Script

STORES = {"p-a": "store-a", "p-b": "store-b", "d-a": "store-a", "d-b": "store-b", "d-b2": "store-b"}


def _load(free_slots: int, total_slots: int = 100) -> DecodeLoad:
    return DecodeLoad(1000, 1000, free_slots, total_slots)


@pytest.fixture(params=["least_load", "prefix_aware"])
def router(request: pytest.FixtureRequest) -> LeastLoadRouter:
    made = (
        LeastLoadRouter(["p-a", "p-b"], ["d-a", "d-b", "d-b2"])
        if request.param == "least_load"
        else PrefixAwareRouter(["p-a", "p-b"], ["d-a", "d-b", "d-b2"], prefix_unit=4)
    )
    made.update_stores(STORES)
    return made


def test_a_decode_on_the_prefill_node_goes_first_within_the_margin(router: LeastLoadRouter):
    router.observe_decode_load("d-a", _load(90))  # the emptiest
    router.observe_decode_load("d-b", _load(80))  # 0.10 below it: within the margin
    router.observe_decode_load("d-b2", _load(50))  # 0.40 below it: past the margin
    assert router.rank_decode(8, 8, near="p-b") == ["d-b", "d-a", "d-b2"]
    assert router.rank_decode(8, 8, near="p-a") == ["d-a", "d-b", "d-b2"]
    assert router.store_of("p-b") == "store-b" and router.store_of("unknown") == ""


def test_the_emptier_worker_wins_past_the_margin(router: LeastLoadRouter):
    below = int(100 * (SAME_NODE_MARGIN + 0.05))
    router.observe_decode_load("d-a", _load(100))
    router.observe_decode_load("d-b", _load(100 - below))
    router.observe_decode_load("d-b2", _load(0))  # full: never moved ahead
    assert router.rank_decode(8, 8, near="p-b") == ["d-a", "d-b", "d-b2"]


def test_a_full_or_silent_worker_on_the_node_is_not_preferred(router: LeastLoadRouter):
    router.observe_decode_load("d-a", _load(50))
    router.observe_decode_load("d-b", _load(0))
    router.observe_decode_load("d-b2", None)
    assert router.rank_decode(8, 8, near="p-b") == ["d-a", "d-b", "d-b2"]


def test_without_stores_or_a_prefill_the_ranking_is_by_load(router: LeastLoadRouter):
    router.observe_decode_load("d-a", _load(90))
    router.observe_decode_load("d-b", _load(80))
    router.observe_decode_load("d-b2", _load(10))
    assert router.rank_decode(8, 8) == ["d-a", "d-b", "d-b2"]
    assert router.rank_decode(8, 8, near="p-unknown") == ["d-a", "d-b", "d-b2"]
    router.update_stores({})
    assert router.rank_decode(8, 8, near="p-b") == ["d-a", "d-b", "d-b2"]


def test_colocated_workers_are_not_reordered_by_node():
    router = LeastLoadRouter(["w-a", "w-b"], ["w-a", "w-b"])
    router.update_stores({"w-a": "store-a", "w-b": "store-b"})
    router.observe_decode_load("w-a", _load(90))
    router.observe_decode_load("w-b", _load(80))
    assert router.rank_decode(8, 8, near="w-b") == ["w-a", "w-b"]


def test_round_robin_keeps_its_rotation():
    router = RoundRobinRouter(["p-a"], ["d-a", "d-b"])
    router.update_stores(STORES)
    firsts = {router.rank_decode(8, 8, near="p-a")[0] for _ in range(4)}
    assert firsts == {"d-a", "d-b"}


def test_the_gateway_reserves_on_the_prefill_node_with_the_prefill_store(tiny_model_path: Path, script: Script):
    with running_gateway(tiny_model_path, script, num_prefill=1, num_decode=2) as gw:
        (prefill,) = gw.router.prefill_addresses
        far, near = gw.router.decode_addresses
        gw.router.update_stores({prefill: "node-b:7", near: "node-b:7", far: "node-a:7"})
        for i in range(4):
            gw.openai().completions.create(model=MODEL, prompt=f"p{i}", max_tokens=3)
        assert [r.source_store_address for r in gw.decodes[1].reserves] == ["node-b:7"] * 4
        assert gw.decodes[0].reserves == []  # equally idle: the node's own decode worker wins
        # the prefill started beside the reservation: into its own node's store, under the key
        # the gateway named and sent to the decode worker too (one per request)
        assert {r.store_address for r in gw.prefill.requests} == {"node-b:7"}
        keys = [r.state_key for r in gw.prefill.requests]
        assert keys == [r.state_key for r in gw.decodes[1].reserves] and len(set(keys)) == 4


def test_without_known_stores_the_decode_picks_its_own_store(tiny_model_path: Path, script: Script):
    with running_gateway(tiny_model_path, script) as gw:
        gw.openai().completions.create(model=MODEL, prompt="p", max_tokens=3)
        assert [r.source_store_address for r in gw.decode.reserves] == [""]  # two hops, as before
