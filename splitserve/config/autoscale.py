"""A pool's autoscaling section and its latency targets (`autoscale:` and `slo:` under a pool).

Without `autoscale` a pool runs `replicas` workers until told otherwise (apply, resize). With
it, the controller's planner (deploy/autoscale/) moves the pool between `min_replicas` and
`max_replicas` by what the gateway observes, against the pool's `slo`.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from splitserve.config.section import Section


class SloConfig(Section):
    """The latency a pool is scaled to keep: time to first token (the prefill pool's concern) and
    inter-token latency (the decode pool's), as the gateway measures them at `percentile`.

    A colocated pool watches both; None leaves that latency unwatched (occupancy and the
    admission queue still count)."""

    ttft_ms: float | None = Field(default=None, gt=0)
    itl_ms: float | None = Field(default=None, gt=0)
    percentile: float = Field(default=90.0, gt=0, lt=100)


class AutoscaleConfig(Section):
    """When the planner adds or removes one replica of a pool (deploy/autoscale/decide.py).

    Every `interval_s` it reads the gateway's load. A pool is *pressed* while its observed
    latency is over its SLO, requests wait for decode room (decode), or its occupancy is over
    `target_occupancy`; it is *idle* while every latency is under `scale_down_below` x its SLO,
    nothing waits, and its occupancy with one replica fewer would stay under
    `scale_down_below` x `target_occupancy`. Pressed for `scale_up_after_s` adds a replica, idle
    for `scale_down_after_s` drains one; between the two bands nothing changes (hysteresis), and
    after a change the pool is left alone for `cooldown_s` (the new replica's load settles).
    """

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=4, ge=1)
    interval_s: float = Field(default=10.0, gt=0)
    scale_up_after_s: float = Field(default=30.0, ge=0)
    scale_down_after_s: float = Field(default=300.0, ge=0)
    cooldown_s: float = Field(default=120.0, ge=0)
    target_occupancy: float = Field(default=0.8, gt=0, le=1)
    scale_down_below: float = Field(default=0.5, gt=0, lt=1)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas}); "
                "give min_replicas <= max_replicas"
            )
        return self

    def clamp(self, replicas: int) -> int:
        """`replicas` brought within [min_replicas, max_replicas]."""
        return max(self.min_replicas, min(self.max_replicas, replicas))
