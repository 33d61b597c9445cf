"""From the gateways' load reports (frontend/load_report.py) to one `Observation` per pool.

`GatewayView.of(reports)` adds several gateways' reports up (queued requests and admitted slots
add; the workers' loads are the same workers seen from each; histogram buckets add).
`observe(...)` takes two views, the last pass's and this one's, and says what the pool went
through in between: latency percentiles over that window, and its load now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deploy.autoscale.decide import Observation
from deploy.autoscale.window import add, difference, quantile
from splitserve.config import SloConfig

HISTOGRAMS = ("ttft_s", "itl_s", "queue_wait_s")


@dataclass(frozen=True)
class GatewayView:
    """What every gateway together knows at one moment."""

    num_queued: int = 0
    num_slots_in_use: int = 0
    num_slots_capacity: int = 0
    decode: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # address -> its Stats figures
    prefill_outstanding: Mapping[str, int] = field(default_factory=dict)  # address -> prompt tokens
    histograms: Mapping[str, list[tuple[float, float]]] = field(default_factory=dict)

    @classmethod
    def of(cls, reports: Sequence[Mapping[str, Any]]) -> GatewayView:
        decode: dict[str, Mapping[str, int]] = {}
        outstanding: dict[str, int] = {}
        for report in reports:
            decode.update(report.get("decode", {}))
            for address, figures in report.get("prefill", {}).items():
                outstanding[address] = outstanding.get(address, 0) + figures["num_outstanding_prompt_tokens"]
        return cls(
            num_queued=sum(r.get("num_queued", 0) for r in reports),
            num_slots_in_use=sum(r.get("num_slots_in_use", 0) for r in reports),
            num_slots_capacity=max((r.get("num_slots_capacity", 0) for r in reports), default=0),
            decode=decode,
            prefill_outstanding=outstanding,
            histograms={
                name: add(r.get("histograms", {}).get(name, []) for r in reports) for name in HISTOGRAMS
            },
        )


def observe(
    role: str,
    now: GatewayView,
    before: GatewayView | None,
    num_replicas: int,
    slo: SloConfig,
    max_num_batched_tokens: int,
) -> Observation:
    """The pool of `role` over the window from `before` to `now` (the whole history without `before`)."""

    def window_ms(name: str) -> float | None:
        earlier = before.histograms.get(name) if before is not None else None
        value_s = quantile(difference(now.histograms.get(name, []), earlier), slo.percentile)
        return None if value_s is None else value_s * 1000.0

    occupancy = (
        _prefill_occupancy(now, max_num_batched_tokens) if role == "prefill" else _decode_occupancy(now)
    )
    return Observation(
        num_replicas=num_replicas,
        ttft_ms=window_ms("ttft_s"),
        itl_ms=window_ms("itl_s"),
        num_queued=now.num_queued,
        occupancy=occupancy,
    )


def _prefill_occupancy(view: GatewayView, max_num_batched_tokens: int) -> float | None:
    """Prompt tokens sent and not yet prefilled, over what the listed workers take in one batch."""
    if not view.prefill_outstanding:
        return None
    capacity = len(view.prefill_outstanding) * max_num_batched_tokens
    return sum(view.prefill_outstanding.values()) / capacity


def _decode_occupancy(view: GatewayView) -> float | None:
    """The fuller of the pool's KV blocks (as the workers last said) and its state slots (the
    admission ledger: what admitted requests hold)."""
    shares = []
    total_blocks = sum(load["num_total_kv_blocks"] for load in view.decode.values())
    if total_blocks > 0:
        free_blocks = sum(load["num_free_kv_blocks"] for load in view.decode.values())
        shares.append(1.0 - free_blocks / total_blocks)
    if view.num_slots_capacity > 0:
        shares.append(view.num_slots_in_use / view.num_slots_capacity)
    return max(shares) if shares else None
