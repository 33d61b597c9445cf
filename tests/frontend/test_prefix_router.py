"""The prefix index and the routing policies: prefix-aware, least-load, round-robin."""

from __future__ import annotations

import pytest

from frontend.prefix_index import CacheEvent, PrefixIndex
from frontend.prefix_router import PrefixAwareRouter
from frontend.router import LeastLoadRouter, RoundRobinRouter, make_router
from splitserve.prefix_hash import prefix_hash_chain

UNIT = 4
A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"


def chain(prefix: list[int], num_tokens: int) -> list[bytes]:
    """The chain of `prefix` followed by a tail of other tokens, `num_tokens` in all."""
    tokens = (prefix + [900 + i for i in range(num_tokens)])[:num_tokens]
    return prefix_hash_chain(tokens, UNIT, b"m")


SHARED = list(range(100, 116))  # 4 units


def test_index_matches_the_longest_unit_a_worker_holds() -> None:
    index = PrefixIndex()
    index.record_sent(A, chain(SHARED, 16), UNIT)
    index.record_sent(B, chain(SHARED[:8], 8), UNIT)
    assert index.match(chain(SHARED, 24)) == {A: 16, B: 8}
    assert index.match(chain([1, 2, 3, 4], 8)) == {}


def test_index_events_add_and_remove_entries() -> None:
    index = PrefixIndex()
    hashes = chain(SHARED, 16)
    index.apply(A, [CacheEvent(True, hashes[1], 8), CacheEvent(True, hashes[3], 16)])
    assert index.match(hashes) == {A: 16}
    index.apply(A, [CacheEvent(False, hashes[3], 16)])
    assert index.match(hashes) == {A: 8}
    index.apply(A, [CacheEvent(False, hashes[1], 8)])
    assert index.match(hashes) == {}
    assert len(index) == 0


def test_index_is_bounded_and_keeps_the_recently_used() -> None:
    index = PrefixIndex(max_entries=6)
    old, new = chain([7] * 16, 16), chain([8] * 16, 16)
    index.record_sent(A, old, UNIT)
    index.record_sent(B, new, UNIT)
    assert len(index) == 6
    assert index.match(new) == {B: 16}
    assert index.match(old) == {A: 16}  # its last two units survived: the longest still counts
    with pytest.raises(ValueError, match="at least 1"):
        PrefixIndex(max_entries=0)


def test_index_forgets_a_restarted_or_departed_worker() -> None:
    index = PrefixIndex()
    hashes = chain(SHARED, 16)
    index.record_sent(A, hashes, UNIT)
    index.record_sent(B, hashes, UNIT)
    index.observe_instance(A, "engine-1")
    index.observe_instance(A, "engine-1")
    assert index.match(hashes) == {A: 16, B: 16}
    index.observe_instance(A, "engine-2")  # a new engine at the same address holds nothing
    assert index.match(hashes) == {B: 16}
    index.keep_only([A])
    assert index.match(hashes) == {}


def test_a_worker_holding_the_prefix_wins_until_its_load_outweighs_it() -> None:
    router = PrefixAwareRouter([A, B], [], prefix_unit=UNIT)
    hashes = chain(SHARED, 20)
    router.on_prefix_sent(B, chain(SHARED, 16))
    # A holds nothing: 20 tokens to compute there; B: 4.
    assert all(router.pick_prefill(20, hashes) == B for _ in range(4))
    router.on_prefill_start(B, 15)  # B's queue: 15 + 4 = 19 < 20
    assert router.pick_prefill(20, hashes) == B
    router.on_prefill_start(B, 2)  # 17 + 4 = 21 > 20
    assert router.pick_prefill(20, hashes) == A
    router.on_prefill_end(B, 17)
    assert router.pick_prefill(20, hashes) == B


def test_with_no_match_prefix_aware_is_least_load_and_ties_rotate() -> None:
    router = PrefixAwareRouter([A, B], [], prefix_unit=UNIT)
    assert {router.pick_prefill(8, chain([5] * 8, 8)) for _ in range(4)} == {A, B}
    router.on_prefill_start(A, 100)
    assert all(router.pick_prefill(8, chain([6] * 8, 8)) == B for _ in range(3))


def test_events_steer_routing_and_a_removed_prefix_stops_attracting() -> None:
    router = PrefixAwareRouter([A, B], [], prefix_unit=UNIT)
    hashes = chain(SHARED, 16)
    router.observe_cache_events(A, "a1", [CacheEvent(True, hashes[-1], 16)])
    assert router.pick_prefill(16, hashes) == A
    router.on_prefill_start(B, 1)  # so a tie no longer rotates to B
    router.observe_cache_events(A, "a1", [CacheEvent(False, hashes[-1], 16)])
    assert router.pick_prefill(16, hashes) == A  # by load now: B has 1 outstanding
    router.on_prefill_end(B, 1)
    assert {router.pick_prefill(16, hashes) for _ in range(4)} == {A, B}


def test_a_snapshot_report_replaces_what_was_believed_of_that_worker_alone() -> None:
    router = PrefixAwareRouter([A, B], [], prefix_unit=UNIT)
    hashes, other = chain(SHARED, 16), chain([4] * 32, 16)
    router.observe_cache_events(A, "a1", [CacheEvent(True, hashes[-1], 16)])
    router.observe_cache_events(B, "b1", [CacheEvent(True, hashes[-1], 16)])
    router.observe_cache_events(A, "a1", [CacheEvent(True, other[-1], 32)], snapshot=True)
    assert router.index.match(hashes) == {B: 16}  # A's earlier unit is gone, B's stays
    assert router.index.match(other) == {A: 32}


def test_a_worker_that_left_the_pool_is_dropped_from_the_index() -> None:
    router = PrefixAwareRouter([A, B], [], prefix_unit=UNIT)
    hashes = chain(SHARED, 16)
    router.on_prefix_sent(A, hashes)
    router.update_workers([B, C], [])
    assert router.index.match(hashes) == {}
    router.observe_cache_events(A, "a1", [CacheEvent(True, hashes[-1], 16)])  # a late report
    assert router.index.match(hashes) == {}
    assert router.pick_prefill(16, hashes) in {B, C}


def test_colocated_decode_ranking_follows_the_prefix() -> None:
    router = PrefixAwareRouter([A, B], [A, B], prefix_unit=UNIT)
    hashes = chain(SHARED, 16)
    router.on_prefix_sent(B, hashes)
    assert all(router.rank_decode(16, 8, hashes)[0] == B for _ in range(4))
    assert {router.rank_decode(16, 8, chain([3] * 16, 16))[0] for _ in range(4)} == {A, B}


def test_disaggregated_decode_ranking_ignores_prefixes() -> None:
    router = PrefixAwareRouter([A], [B, C], prefix_unit=UNIT)
    router.on_prefix_sent(A, chain(SHARED, 16))
    assert {router.rank_decode(16, 8, chain(SHARED, 16))[0] for _ in range(4)} == {B, C}


def test_round_robin_ignores_load_and_cache() -> None:
    router = RoundRobinRouter([A, B, C], [A, B])
    router.on_prefill_start(A, 10**6)
    picks = [router.pick_prefill(8) for _ in range(6)]
    assert picks == [A, B, C, A, B, C]
    assert [router.rank_decode(8, 8) for _ in range(2)] == [[A, B], [B, A]]


def test_make_router_by_policy() -> None:
    assert type(make_router("least_load", UNIT)) is LeastLoadRouter
    assert type(make_router("round_robin", UNIT)) is RoundRobinRouter
    prefix = make_router("prefix_aware", 64)
    assert isinstance(prefix, PrefixAwareRouter) and prefix.prefix_unit == 64
    with pytest.raises(ValueError, match="router.policy"):
        make_router("random", UNIT)  # type: ignore[arg-type]


def test_decode_workers_ends_match_the_prompts_that_extend_them() -> None:
    router = PrefixAwareRouter([A], [B, C], prefix_unit=UNIT)
    history = SHARED + [7, 8]  # 18 tokens kept: its deepest whole unit is the fourth
    hashes = chain(history, 18)
    router.on_decode_retained(B, hashes[3], 18)
    assert router.decode_prefix_match(chain(history, 30)) == {B: 18}  # the next turn extends it
    # a prompt that leaves it inside its units is not served by that end (no state kept there)
    assert router.decode_prefix_match(chain(SHARED[:12], 30)) == {}
    router.on_decode_retained(A, hashes[3], 18)  # a prefill worker: not a decode worker's end
    assert router.decode_prefix_match(hashes) == {B: 18}


def test_a_refused_local_prefill_and_a_departed_decode_worker_are_forgotten() -> None:
    router = PrefixAwareRouter([A], [B, C], prefix_unit=UNIT)
    hashes = chain(SHARED, 16)
    router.on_decode_retained(B, hashes[3], 16)
    router.on_decode_retained(C, hashes[3], 16)
    router.on_local_prefill_refused(B, chain(SHARED, 24))
    assert router.decode_prefix_match(hashes) == {C: 16}
    router.update_workers([A], [B])
    assert router.decode_prefix_match(hashes) == {}


@pytest.mark.parametrize("router", [LeastLoadRouter([A], [B]), RoundRobinRouter([A], [B])])
def test_routers_without_a_prefix_index_believe_no_decode_worker_holds_anything(router) -> None:  # type: ignore[no-untyped-def]
    router.on_decode_retained(B, chain(SHARED, 16)[3], 16)
    assert router.decode_prefix_match(chain(SHARED, 16)) == {}
