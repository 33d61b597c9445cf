"""Starting a prompt: which way it runs, and running it again when a worker is lost before its first token.

One try (`_start_once`) routes the prompt and runs it one of three ways: on a decode worker that
computes it itself (no prefill worker can take it and `prefill.fallback: decode_local`, or
`router.local_prefill_max_tokens` finds one holding all but a few of its tokens:
frontend/local_start.py), else disaggregated (a reservation and a prefill:
frontend/disaggregated.py). A try that finds no decode worker reachable waits for one
(`decode.failover_wait_s`); a prefill lost with its worker or that worker's store runs again
elsewhere. Nothing reached the client before the first step, so a client sees one answer.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from frontend.backoff import Backoff
from frontend.disaggregated import DecodeUnreachable, PrefillLost, reserve_and_prefill
from frontend.errors import unavailable
from frontend.local_start import local_target, start_local, start_on_decode
from frontend.steps import Step

if TYPE_CHECKING:
    from frontend.generate import Generation

logger = logging.getLogger(__name__)

# A prompt whose prefill failed for want of its worker or that worker's store (503) is tried
# again on another prefill worker or through prefill.fallback, at most this many times.
MAX_PREFILL_RETRIES = 2


async def start(gen: Generation) -> Step:
    """Reserve a decode slot, run the prefill; the first step (maybe already final).

    A prefill that fails because its worker or that worker's store cannot be reached (it
    died, its store is restarting) is run again, the room it held given back first: on
    another prefill worker, else through `prefill.fallback` (`decode_local`: the decode
    worker computes the prompt, no store needed). Nothing reached the client yet, so the
    client sees one answer, with the tokens an unbroken run gives."""
    failed: list[str] = []
    settings, metrics = gen.p.settings, gen.p.metrics
    backoff = Backoff(min(gen.deadline_s, time.monotonic() + settings.decode_failover_wait_s))
    while True:
        try:
            return await _start_once(gen, failed)
        except DecodeUnreachable:
            await gen.held.release_decode()
            if not await backoff.wait():  # none came back in time: the 503 stands
                raise
        except PrefillLost as lost:
            failed.append(lost.address)
            await gen.held.release_decode()
            if len(failed) > MAX_PREFILL_RETRIES:
                raise
            reachable = await gen.p.probe(lost.address)
            logger.warning(
                "request %s: prefill on %s failed (%s; the worker %s); running the prompt elsewhere",
                gen.request_id,
                lost.address,
                lost.message,
                "answers" if reachable else "is unreachable",
            )
            metrics.prefill_retries.labels(metrics.model_name).inc()


async def _start_once(gen: Generation, failed_prefill: list[str]) -> Step:
    """One try of `start`, on a prefill worker not in `failed_prefill` (or none)."""
    router = gen.p.router
    num_prompt_tokens = len(gen.prompt_ids)
    prefill_address = router.pick_prefill(num_prompt_tokens, gen.prefix_hashes, failed_prefill)
    candidates = router.rank_decode(
        num_prompt_tokens, gen.params.max_tokens or 0, gen.prefix_hashes, near=prefill_address
    )
    if not candidates:
        listed = router.decode_addresses
        if not listed:
            raise unavailable("no decode workers are available; try again later")
        raise DecodeUnreachable(_no_decode_worker(listed, router.unreachable()))
    if prefill_address is None:
        return await start_on_decode(gen, candidates[0], failed_prefill)
    local = local_target(gen, candidates)
    if local is not None:
        step = await start_local(gen, local)
        if step is not None:
            return step
    response = await reserve_and_prefill(gen, prefill_address, candidates)
    return await gen.prefilled(response)


def _no_decode_worker(listed: tuple[str, ...], unreachable: dict[str, str]) -> str:
    """Why none of the `listed` decode workers can be tried, for a 503."""
    down = "; ".join(f"{a}: {unreachable[a]}" for a in listed if a in unreachable)
    return f"no decode worker can be reached ({down}); try again later"
