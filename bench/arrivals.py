"""When each request (or session) of a run is sent: at once, or as a seeded Poisson process."""

from __future__ import annotations

import math
import random


def arrival_offsets(
    num_arrivals: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Send times in seconds from the start, the first at 0.

    An infinite rate sends everything at 0. A finite one draws the gaps from a gamma
    distribution with shape `burstiness` and mean `1 / request_rate`: burstiness 1 is a Poisson
    process (exponential gaps); below 1 burstier, above 1 more regular (as vLLM's `--burstiness`).
    The same arguments give the same offsets.
    """
    check_arrivals(request_rate, burstiness)
    if math.isinf(request_rate):
        return [0.0] * num_arrivals
    rng = random.Random(f"arrivals:{seed}")  # its own stream: the dataset draws from `seed` itself
    scale_s = 1.0 / (request_rate * burstiness)
    offsets, now_s = [], 0.0
    for _ in range(num_arrivals):
        offsets.append(now_s)
        now_s += rng.gammavariate(burstiness, scale_s)
    return offsets


def check_arrivals(request_rate: float, burstiness: float) -> None:
    """Raise ValueError unless the rate is positive (or inf) and the burstiness positive."""
    if request_rate <= 0 or math.isnan(request_rate):
        raise ValueError(f"request rate must be positive or inf (got {request_rate})")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive (got {burstiness})")
