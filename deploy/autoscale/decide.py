"""The autoscaler's decision for one pool at one pass: a pure function of what was observed,
the pool's knobs and what the pool went through before (no clock, no I/O).

Pressure and idleness are judged by the pool's role, as Dynamo's planner scales prefill by TTFT
and decode by ITL:

* prefill: TTFT over `slo.ttft_ms` (only while no request waits for decode room: then the
  decode pool, not prefill, holds the first token back), or outstanding prompt tokens over
  `target_occupancy` of the pool's batch capacity;
* decode: ITL over `slo.itl_ms`, requests waiting for decode room, or KV/slot occupancy over
  `target_occupancy`;
* colocated: all of these.

A pool is idle when none of those holds with margin: every watched latency under
`scale_down_below` x its SLO (or no request measured), nothing queued, and the occupancy it
would have with one replica fewer under `scale_down_below` x `target_occupancy`. See
`AutoscaleConfig` for the timing (sustained for `scale_up_after_s`/`scale_down_after_s`, then
`cooldown_s` after a change).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from splitserve.config import AutoscaleConfig, SloConfig

Direction = Literal["up", "down", "held", "hold"]


@dataclass(frozen=True)
class Observation:
    """One pool as the gateway saw it over the last window.

    `ttft_ms`/`itl_ms` are at the SLO's percentile over the window (None: nothing measured);
    `num_queued` counts requests waiting for decode room; `occupancy` is the share of the pool's
    capacity in use (decode: the fuller of KV blocks and state slots; prefill: outstanding prompt
    tokens over the replicas' batch tokens), None while unknown.
    """

    num_replicas: int
    ttft_ms: float | None = None
    itl_ms: float | None = None
    num_queued: int = 0
    occupancy: float | None = None


@dataclass(frozen=True)
class Track:
    """What the planner remembers of a pool between passes: since when it has been pressed or
    idle without a break, and when its last change ended (for the cool-down)."""

    pressed_since_s: float | None = None
    idle_since_s: float | None = None
    changed_at_s: float | None = None

    def after_change(self, now_s: float) -> Track:
        """A change just ended: the cool-down starts, and pressure or idleness is judged afresh."""
        return Track(changed_at_s=now_s)


@dataclass(frozen=True)
class Decision:
    """`desired` replicas and why. `direction`: up or down (act), held (an up the bounds or the
    cluster refused: stays), hold (nothing to do). `reason` is a short label from a fixed set
    (a metric label); `detail` says it in words, with the figures."""

    direction: Direction
    desired: int
    reason: str
    detail: str
    track: Track


def decide(
    role: str,
    seen: Observation,
    scale: AutoscaleConfig,
    slo: SloConfig,
    track: Track,
    now_s: float,
    no_room: str | None = None,
) -> Decision:
    """The decision for a pool of `role` ("prefill", "decode" or "colocated") at `now_s`.

    `no_room`: why the cluster cannot hold one more replica of the pool (None: it can)."""
    n = seen.num_replicas
    if n < scale.min_replicas:
        return Decision("up", scale.min_replicas, "below_min", f"{n} replicas < min_replicas", track)
    if n > scale.max_replicas:
        return Decision("down", scale.max_replicas, "above_max", f"{n} replicas > max_replicas", track)
    pressure = _pressure(role, seen, scale, slo)
    idle = None if pressure else _idle(role, seen, scale, slo)
    track = replace(
        track,
        pressed_since_s=_since(track.pressed_since_s, now_s) if pressure else None,
        idle_since_s=_since(track.idle_since_s, now_s) if idle else None,
    )
    if track.changed_at_s is not None and now_s - track.changed_at_s < scale.cooldown_s:
        return Decision(
            "hold", n, "cooldown", f"a change ended {now_s - track.changed_at_s:.1f} s ago", track
        )
    if pressure:
        reason, detail = pressure[0]
        words = "; ".join(text for _, text in pressure)
        assert track.pressed_since_s is not None
        if now_s - track.pressed_since_s < scale.scale_up_after_s:
            return Decision(
                "hold", n, "pressed", f"{words} (for {now_s - track.pressed_since_s:.1f} s)", track
            )
        if n >= scale.max_replicas:
            return Decision("held", n, "at_max", f"{words}; already at max_replicas {n}", track)
        if no_room is not None:
            return Decision("held", n, "does_not_fit", f"{words}; one more does not fit: {no_room}", track)
        return Decision("up", n + 1, reason, words, track)
    if idle is not None:
        assert track.idle_since_s is not None
        if now_s - track.idle_since_s >= scale.scale_down_after_s and n > scale.min_replicas:
            return Decision("down", n - 1, "idle", f"{idle} for {now_s - track.idle_since_s:.1f} s", track)
        return Decision("hold", n, "idle", idle, track)
    return Decision("hold", n, "steady", "between the scale-up and scale-down bands", track)


def _pressure(role: str, seen: Observation, scale: AutoscaleConfig, slo: SloConfig) -> list[tuple[str, str]]:
    """(reason, words) for each signal over its target; empty when none is."""
    found = []
    p = f"p{slo.percentile:g}"
    prefill, decode = role in ("prefill", "colocated"), role in ("decode", "colocated")
    if prefill and _over(seen.ttft_ms, slo.ttft_ms) and not (role == "prefill" and seen.num_queued):
        found.append(("ttft", f"TTFT {p} {seen.ttft_ms:.0f} ms > SLO {slo.ttft_ms:g} ms"))
    if decode and _over(seen.itl_ms, slo.itl_ms):
        found.append(("itl", f"ITL {p} {seen.itl_ms:.1f} ms > SLO {slo.itl_ms:g} ms"))
    if decode and seen.num_queued > 0:
        found.append(("queue", f"{seen.num_queued} request(s) wait for decode room"))
    if seen.occupancy is not None and seen.occupancy > scale.target_occupancy:
        found.append(("occupancy", f"occupancy {seen.occupancy:.2f} > target {scale.target_occupancy:g}"))
    return found


def _idle(role: str, seen: Observation, scale: AutoscaleConfig, slo: SloConfig) -> str | None:
    """The words saying why the pool is idle, or None if it is not (with margin)."""
    below = scale.scale_down_below
    watched = []
    if role in ("prefill", "colocated"):
        watched.append((seen.ttft_ms, slo.ttft_ms))
    if role in ("decode", "colocated"):
        watched.append((seen.itl_ms, slo.itl_ms))
        if seen.num_queued:
            return None
    if any(_over(value, None if target is None else below * target) for value, target in watched):
        return None
    n = seen.num_replicas
    if seen.occupancy is None or n < 1:
        return None
    if n == 1 and seen.occupancy > 0:  # to none (a prefill pool under decode_local): only with nothing in it
        return None
    projected = seen.occupancy * n / (n - 1) if n > 1 else 0.0
    if projected >= below * scale.target_occupancy:
        return None
    return f"occupancy {seen.occupancy:.2f} ({projected:.2f} with one replica fewer), latencies within SLO"


def _since(since_s: float | None, now_s: float) -> float:
    return now_s if since_s is None else since_s


def _over(value: float | None, limit: float | None) -> bool:
    return value is not None and limit is not None and value > limit
