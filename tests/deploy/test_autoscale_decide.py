"""The autoscaler's decision (deploy/autoscale/decide.py) on scripted observations: a pool goes
up under pressure that lasts, down after idleness that lasts, never past its bounds or what
fits, not at all inside the hysteresis band or the cool-down."""

from __future__ import annotations

from deploy.autoscale.decide import Decision, Observation, Track, decide
from splitserve.config import AutoscaleConfig, SloConfig

SCALE = AutoscaleConfig(
    min_replicas=1,
    max_replicas=3,
    scale_up_after_s=10,
    scale_down_after_s=60,
    cooldown_s=30,
    target_occupancy=0.8,
    scale_down_below=0.5,
)
SLO = SloConfig(ttft_ms=500, itl_ms=50)
BUSY = Observation(num_replicas=1, itl_ms=120, num_queued=3, occupancy=1.0)
QUIET = Observation(num_replicas=2, itl_ms=10, occupancy=0.1)


def run(role: str, script: list[tuple[float, Observation]], no_room: str | None = None) -> list[Decision]:
    """Decide at each scripted time, carrying the track along; a change starts the cool-down."""
    track, out = Track(), []
    for now_s, seen in script:
        decision = decide(role, seen, SCALE, SLO, track, now_s, no_room)
        track = decision.track.after_change(now_s) if decision.direction in ("up", "down") else decision.track
        out.append(decision)
    return out


def directions(decisions: list[Decision]) -> list[str]:
    return [d.direction for d in decisions]


def test_decode_goes_up_once_itl_and_queue_pressure_lasts_scale_up_after_s():
    first, second, third = run("decode", [(0, BUSY), (5, BUSY), (10, BUSY)])
    assert (first.direction, first.reason) == ("hold", "pressed") and second.direction == "hold"
    assert (third.direction, third.desired, third.reason) == ("up", 2, "itl")
    assert (
        "ITL p90 120.0 ms > SLO 50 ms" in third.detail and "3 request(s) wait for decode room" in third.detail
    )


def test_a_queue_alone_presses_decode_and_occupancy_alone_presses_either_pool():
    queued = Observation(num_replicas=1, num_queued=1)
    assert run("decode", [(0, queued), (10, queued)])[-1].reason == "queue"
    full = Observation(num_replicas=1, occupancy=0.9)
    assert run("prefill", [(0, full), (10, full)])[-1].reason == "occupancy"


def test_prefill_scales_by_ttft_but_not_while_requests_wait_for_decode_room():
    slow = Observation(num_replicas=1, ttft_ms=900, occupancy=0.0)
    assert run("prefill", [(0, slow), (10, slow)])[-1].reason == "ttft"
    held_back_by_decode = Observation(num_replicas=1, ttft_ms=900, num_queued=4, occupancy=0.0)
    assert directions(run("prefill", [(0, held_back_by_decode), (10, held_back_by_decode)])) == [
        "hold",
        "hold",
    ]
    # prefill does not watch ITL or the decode queue, nor decode TTFT
    decode_pressed = Observation(num_replicas=1, itl_ms=120, num_queued=3, occupancy=0.0)
    assert directions(run("prefill", [(0, decode_pressed), (10, decode_pressed)])) == ["hold", "hold"]
    decode_slow_ttft = Observation(num_replicas=1, ttft_ms=900, occupancy=0.0)
    assert directions(run("decode", [(0, decode_slow_ttft), (10, decode_slow_ttft)])) == ["hold", "hold"]


def test_a_colocated_pool_watches_both_latencies():
    slow_first_token = Observation(num_replicas=1, ttft_ms=900, occupancy=0.0)
    assert run("colocated", [(0, slow_first_token), (10, slow_first_token)])[-1].reason == "ttft"


def test_pressure_that_breaks_restarts_the_wait():
    calm = Observation(num_replicas=1, itl_ms=40, occupancy=0.5)  # in the band: neither
    decisions = run("decode", [(0, BUSY), (8, calm), (9, BUSY), (18, BUSY), (19, BUSY)])
    assert directions(decisions) == ["hold", "hold", "hold", "hold", "up"]


def test_down_only_after_idleness_lasts_scale_down_after_s_and_never_below_min():
    decisions = run("decode", [(0, QUIET), (30, QUIET), (60, QUIET)])
    assert directions(decisions) == ["hold", "hold", "down"]
    assert decisions[-1].desired == 1 and decisions[-1].reason == "idle"
    alone = Observation(num_replicas=1, occupancy=0.0)
    assert directions(run("decode", [(0, alone), (600, alone)])) == ["hold", "hold"]


def test_hysteresis_a_load_one_replica_fewer_could_not_carry_keeps_the_replica():
    # 0.25 on 2 replicas is 0.5 on one: over scale_down_below x target (0.4), so not idle;
    # and not pressed either (under 0.8): the band where nothing changes
    middling = Observation(num_replicas=2, itl_ms=10, occupancy=0.25)
    decisions = run("decode", [(t, middling) for t in range(0, 600, 60)])
    assert {d.direction for d in decisions} == {"hold"} and decisions[-1].reason == "steady"
    # latency between half the SLO and the SLO: also the band
    warm = Observation(num_replicas=2, itl_ms=30, occupancy=0.0)
    assert {d.direction for d in run("decode", [(t, warm) for t in range(0, 600, 60)])} == {"hold"}


def test_an_alternating_load_does_not_flap():
    script = [(t, BUSY if (t // 20) % 2 == 0 else QUIET) for t in range(0, 400, 5)]
    script = [(t, Observation(**{**seen.__dict__, "num_replicas": 2})) for t, seen in script]
    changes = [d for d in run("decode", script) if d.direction in ("up", "down")]
    # every BUSY spell (20 s) outlasts scale_up_after_s once; no QUIET spell reaches 60 s
    assert {d.direction for d in changes} == {"up"}


def test_the_cool_down_holds_the_next_change_back():
    track = Track(changed_at_s=100)
    during = decide("decode", BUSY, SCALE, SLO, track, 115)
    assert (during.direction, during.reason) == ("hold", "cooldown")
    # the pressure was timed through the cool-down: at its end the pool goes up at once
    after = decide("decode", BUSY, SCALE, SLO, during.track, 130)
    assert after.direction == "up" and after.track.pressed_since_s == 115


def test_at_max_it_is_held_and_says_so():
    at_max = Observation(**{**BUSY.__dict__, "num_replicas": 3})
    last = run("decode", [(0, at_max), (10, at_max)])[-1]
    assert (last.direction, last.desired, last.reason) == ("held", 3, "at_max")
    assert "already at max_replicas 3" in last.detail


def test_when_one_more_does_not_fit_it_is_held_with_the_clusters_reason():
    last = run(
        "decode", [(0, BUSY), (10, BUSY)], no_room="they need CPU 1, and the cluster has CPU 2 in all"
    )[-1]
    assert (last.direction, last.desired, last.reason) == ("held", 1, "does_not_fit")
    assert "one more does not fit: they need CPU 1" in last.detail


def test_outside_the_bounds_it_goes_back_within_them_first():
    below = decide("decode", Observation(num_replicas=0), SCALE, SLO, Track(), 0)
    above = decide("decode", Observation(num_replicas=5, occupancy=1.0), SCALE, SLO, Track(), 0)
    assert (below.direction, below.desired, below.reason) == ("up", 1, "below_min")
    assert (above.direction, above.desired, above.reason) == ("down", 3, "above_max")


def test_a_pool_with_nothing_measured_is_neither_pressed_nor_idle():
    unknown = Observation(num_replicas=2)
    assert {d.reason for d in run("decode", [(t, unknown) for t in range(0, 600, 60)])} == {"steady"}
