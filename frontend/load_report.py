"""What the gateway knows of the load on its pools, as one plain snapshot for the autoscaler.

`load_report(app)` reads, without touching any worker: the admission queue (requests waiting
for decode room, the slots admitted requests hold, the pool's capacity), each decode worker's
free KV blocks and state slots as its last `Decode.Stats` said, each prefill worker's
outstanding prompt tokens (sent by this gateway, not yet prefilled), and the cumulative bucket
counts of the TTFT, ITL and admission-wait histograms. Counts are cumulative since the gateway
started, as Prometheus keeps them: a reader takes the difference of two reports for a window
(deploy/autoscale/window.py), and several gateways' reports add up.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI
from prometheus_client import Histogram


def load_report(app: FastAPI) -> dict[str, Any]:
    """The snapshot described in the module docstring; JSON-ready (bucket bounds as floats, +inf
    as the string "+Inf")."""
    pipeline, queue, monitor = app.state.pipeline, app.state.admission_queue, app.state.monitor
    router, metrics = pipeline.router, pipeline.metrics
    outstanding = getattr(router, "outstanding_prefill_tokens", lambda address: 0)
    loads = dict(monitor.decode_loads)  # a copy: the event loop's thread replaces entries
    return {
        "num_queued": queue.num_queued,
        "num_slots_in_use": queue.num_slots_in_use,
        "num_slots_capacity": queue.capacity_slots or 0,
        "decode": {
            address: {
                "num_free_kv_blocks": load.num_free_kv_blocks,
                "num_total_kv_blocks": load.num_total_kv_blocks,
                "num_free_state_slots": load.num_free_state_slots,
                "num_total_state_slots": load.num_total_state_slots,
            }
            for address, load in loads.items()
            if address in router.decode_addresses
        },
        "prefill": {
            address: {"num_outstanding_prompt_tokens": int(outstanding(address))}
            for address in router.prefill_addresses
            if address not in router.decode_addresses  # colocated: counted as decode
        },
        "histograms": {
            "ttft_s": bucket_counts(metrics.ttft),
            "itl_s": bucket_counts(metrics.itl),
            "queue_wait_s": bucket_counts(queue.metrics.queued_s),
        },
    }


def bucket_counts(histogram: Histogram) -> list[tuple[float | str, float]]:
    """[(upper bound, cumulative count)] of a histogram, summed over its label sets."""
    counts: dict[float, float] = {}
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return [("+Inf" if math.isinf(bound) else bound, count) for bound, count in sorted(counts.items())]
