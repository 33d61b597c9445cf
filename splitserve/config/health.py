"""The `health` section: how the controller watches, restarts and stops its actors."""

from __future__ import annotations

from pydantic import Field

from splitserve.config.section import Section


class HealthConfig(Section):
    """How the controller watches and stops its actors: a `health()` call every `interval_s`,
    each allowed `timeout_s`; a dead or failing actor is restarted at most `max_restarts` times.
    Only restarts within the last `restart_window_s` count against `max_restarts`.
    `start_timeout_s` bounds an actor's `start()` (which loads the model). On stop, and for the
    workers a scale-down removes, requests in flight get `drain_timeout_s` to finish."""

    interval_s: float = Field(default=5, gt=0)
    # stats() answers from the engine's last snapshot, not behind its step; a stuck engine shows
    # as a step running past 30 x timeout_s (deploy/health.py)
    timeout_s: float = Field(default=10, gt=0)
    max_restarts: int = Field(default=3, ge=0)
    # restarts older than this no longer count against max_restarts (0: every restart ever counts),
    # so a worker that crashes once a day is not given up on after three days
    restart_window_s: float = Field(default=600, ge=0)
    start_timeout_s: float = Field(default=300, gt=0)
    drain_timeout_s: float = Field(default=30, ge=0)
