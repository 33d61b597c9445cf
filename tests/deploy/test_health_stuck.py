"""The health watcher's stuck-engine verdict, from what a worker's `stats()` says.

tests/workers/test_stats_during_a_long_step.py runs the whole probe against real workers whose
step the test holds; this pins the limit itself."""

from __future__ import annotations

from deploy.health import STUCK_AFTER_TIMEOUTS, stuck_engine

TIMEOUT_S = 10.0
LIMIT_S = STUCK_AFTER_TIMEOUTS * TIMEOUT_S


def test_a_step_up_to_the_limit_is_not_stuck() -> None:
    assert stuck_engine({"stats_age_s": 0.0}, TIMEOUT_S) is None
    assert stuck_engine({"stats_age_s": LIMIT_S}, TIMEOUT_S) is None


def test_a_step_past_the_limit_is_stuck_and_the_reason_names_the_limit() -> None:
    reason = stuck_engine({"stats_age_s": LIMIT_S + 1}, TIMEOUT_S)
    assert reason is not None and reason.startswith("engine stuck")
    assert f"{LIMIT_S:g} s" in reason and "health.timeout_s" in reason


def test_stats_without_an_age_never_say_stuck() -> None:
    # stores and older workers report no stats_age_s; a non-number is not an age
    assert stuck_engine({"num_keys": 3}, TIMEOUT_S) is None
    assert stuck_engine({"stats_age_s": "long"}, TIMEOUT_S) is None
