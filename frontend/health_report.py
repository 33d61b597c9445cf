"""What `/health` says: whether this gateway can serve a request now, and if not fully, why.

Read from what the gateway already knows, no call made: the pools the controller published,
the workers the gateway found unreachable (its polls and its requests' calls, in the router) and
the decode workers' last Stats (the load monitor). A decode worker can take a request when it is
reachable and not wedged: a worker with no free state slot whose slots are held by nothing it
runs or has reserved (a leak) will never free them. A prefill pool with no reachable worker is
served around with `prefill.fallback: decode_local` (the decode worker computes the prompt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

STATUS_OK = "ok"
STATUS_DEGRADED = "degraded"  # serving, but not with everything (200), or not at all (503)
STATUS_NO_WORKERS = "no workers"
STATUS_DRAINING = "draining"


@dataclass(frozen=True)
class HealthReport:
    """The answer: `serving` picks 200 or 503; `problems` says what is wrong, one line each."""

    status: str
    serving: bool
    prefill_workers: int  # prefill workers that can take a prompt now
    decode_workers: int  # decode workers that can take a request now
    problems: list[str] = field(default_factory=list)


def health_report(
    prefill: Sequence[str],
    decode: Sequence[str],
    unreachable: Mapping[str, str],
    idle_held_slots: Mapping[str, int],
    full: set[str],
    prefill_fallback: str,
    draining: bool = False,
) -> HealthReport:
    """The report for these pools (`prefill`, `decode`: the addresses published; colocated: the
    same list twice) given what is known of each worker."""
    problems = [f"worker {a} is unreachable: {why}" for a, why in sorted(unreachable.items())]
    problems += [
        f"decode worker {a} holds {n} state slots with nothing running or reserved"
        for a, n in sorted(idle_held_slots.items())
        if n > 0
    ]
    wedged = {a for a in full if idle_held_slots.get(a, 0) > 0}
    prefill_ok = [a for a in prefill if a not in unreachable]
    decode_ok = [a for a in decode if a not in unreachable and a not in wedged]
    counts = {"prefill_workers": len(prefill_ok), "decode_workers": len(decode_ok)}
    if draining:
        return HealthReport(STATUS_DRAINING, False, **counts, problems=problems)
    if not decode or (not prefill and prefill_fallback != "decode_local"):
        missing = "decode" if not decode else "prefill"
        problems.append(f"the {missing} pool has no worker")
        return HealthReport(STATUS_NO_WORKERS, False, **counts, problems=problems)
    if not decode_ok:
        problems.append("no decode worker can take a request")
    elif not prefill_ok:
        if prefill_fallback == "decode_local":
            problems.append(
                "no prefill worker can take a prompt: decode workers compute prompts (decode_local)"
            )
        else:
            problems.append("no prefill worker can take a prompt (prefill.fallback: fail)")
    serving = bool(decode_ok) and (bool(prefill_ok) or prefill_fallback == "decode_local")
    status = STATUS_OK if serving and not problems else STATUS_DEGRADED
    return HealthReport(status, serving, **counts, problems=problems)
