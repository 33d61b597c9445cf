"""LeastLoadRouter: prefill by outstanding tokens, decode by free room, pools resized live."""

from __future__ import annotations

from frontend.router import DecodeLoad, LeastLoadRouter


def _load(free_blocks: int, free_slots: int, total_blocks: int = 100, total_slots: int = 8) -> DecodeLoad:
    return DecodeLoad(free_blocks, total_blocks, free_slots, total_slots)


def test_prefill_goes_to_the_worker_with_fewest_outstanding_tokens():
    router = LeastLoadRouter(["p0", "p1"], ["d0"])
    router.on_prefill_start("p0", 500)
    assert router.pick_prefill(10) == "p1"
    router.on_prefill_start("p1", 800)
    assert router.pick_prefill(10) == "p0"
    router.on_prefill_end("p1", 800)
    assert router.pick_prefill(10) == "p1"
    assert router.outstanding_prefill_tokens("p0") == 500


def test_idle_prefill_workers_take_turns():
    router = LeastLoadRouter(["p0", "p1", "p2"], ["d0"])
    assert {router.pick_prefill(1) for _ in range(6)} == {"p0", "p1", "p2"}


def test_decode_ranks_by_free_share_of_the_tighter_resource():
    router = LeastLoadRouter(["p0"], ["d0", "d1", "d2"])
    router.observe_decode_load("d0", _load(free_blocks=90, free_slots=1))  # slots are tight: 1/8
    router.observe_decode_load("d1", _load(free_blocks=50, free_slots=8))  # 0.5
    router.observe_decode_load("d2", _load(free_blocks=10, free_slots=8))  # 0.1
    assert router.rank_decode(10, 10) == ["d1", "d0", "d2"]


def test_full_and_silent_decode_workers_go_last():
    router = LeastLoadRouter(["p0"], ["full", "silent", "fresh", "ok"])
    router.observe_decode_load("full", _load(free_blocks=90, free_slots=0))
    router.observe_decode_load("silent", None)
    router.observe_decode_load("ok", _load(free_blocks=10, free_slots=1))
    ranked = router.rank_decode(10, 10)
    assert ranked[:2] == ["fresh", "ok"]  # never measured: tried first, so new replicas get traffic
    assert ranked[2:] == ["full", "silent"]


def test_accepted_reservations_lower_a_worker_until_fresh_stats():
    router = LeastLoadRouter(["p0"], ["d0", "d1"])
    router.observe_decode_load("d0", _load(100, 2))
    router.observe_decode_load("d1", _load(100, 1))
    assert router.rank_decode(1, 1)[0] == "d0"
    router.on_decode_reserved("d0")
    router.on_decode_reserved("d0")
    assert router.rank_decode(1, 1) == ["d1", "d0"]  # d0 has no slot left by local count
    router.observe_decode_load("d0", _load(100, 2))
    assert router.rank_decode(1, 1)[0] == "d0"


def test_update_workers_resizes_the_pools_and_forgets_removed_workers():
    router = LeastLoadRouter(["p0"], ["d0"])
    router.on_prefill_start("p0", 100)
    router.update_workers(["p0", "p1", "p1"], ["d1"])
    assert router.prefill_addresses == ("p0", "p1")
    assert router.decode_addresses == ("d1",)
    assert router.outstanding_prefill_tokens("p0") == 100  # kept for a worker still present
    assert router.rank_decode(1, 1) == ["d1"]
    router.observe_decode_load("d0", _load(100, 8))  # a removed worker's late Stats are ignored
    assert router.rank_decode(1, 1) == ["d1"]
    router.update_workers([], [])
    assert router.pick_prefill(1) is None and router.rank_decode(1, 1) == []
