"""Starts where a decode worker computes the prompt itself: no prefill worker, no handoff.

Two ways a prompt lands there: no prefill worker can take it and `prefill.fallback` is
`decode_local` (`start_on_decode`), or conditional disaggregation (`router.local_prefill_max_tokens`)
finds a decode worker believed to hold all but a few of its tokens in its prefix cache
(`local_target`, `start_local`). Either way the gateway sends one Decode without state (the
decode worker takes a slot per sample, as a reservation would) and its stream carries the first
token too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from frontend.errors import GatewayError, unavailable
from frontend.steps import Step
from splitserve.v1 import decode_pb2
from splitserve.wire import sampling_params_to_proto

if TYPE_CHECKING:
    from frontend.generate import Generation

logger = logging.getLogger(__name__)

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION  # a decode worker refusing a local prefill


async def start_on_decode(gen: Generation, address: str, failed_prefill: Sequence[str] = ()) -> Step:
    """No prefill worker can take the prompt (the pool is empty or unreachable, or the ones
    left failed it): with `prefill.fallback: decode_local` the decode worker computes the
    prompt itself (a Decode without state) and streams every token; else 503."""
    settings, router, metrics = gen.p.settings, gen.p.router, gen.p.metrics
    policy = settings.prefill_fallback
    metrics.prefill_fallbacks.labels(metrics.model_name, policy).inc()
    if policy != "decode_local":
        why = "has no worker" if not router.prefill_addresses else "has no worker that can take it"
        if failed_prefill:
            why += f" (failed on {', '.join(failed_prefill)})"
        raise unavailable(f"the prefill pool {why}; prefill.fallback is fail: retry later")
    return await _decode_whole(gen, address, max_uncached_tokens=0)


def local_target(gen: Generation, candidates: list[str]) -> str | None:
    """The decode worker to prefill this prompt itself (`router.local_prefill_max_tokens`):
    among the candidates believed to have room, the one believed to hold the longest prefix
    of it, if at most the limit of its tokens is left to compute there. None: a prefill
    worker computes it (the limit is 0, a failover re-prefill, or a colocated pool)."""
    router = gen.p.router
    limit = gen.p.settings.local_prefill_max_tokens
    if not limit or gen.resumed_ids:
        return None
    if any(address in router.prefill_addresses for address in candidates):
        return None
    matched = router.decode_prefix_match(gen.prefix_hashes)
    num_prompt_tokens = len(gen.prompt_ids)
    fits = [
        address
        for address in candidates
        if num_prompt_tokens - matched.get(address, 0) <= limit and router.decode_has_room(address)
    ]
    return max(fits, key=lambda address: matched.get(address, 0), default=None)


async def start_local(gen: Generation, address: str) -> Step | None:
    """A local prefill on decode worker `address`: its first step, or None when the worker
    holds less of the prompt than believed (it started nothing; counted) and a prefill
    worker must compute it."""
    metrics = gen.p.metrics
    outcomes = metrics.local_prefills
    try:
        step = await _decode_whole(gen, address, gen.p.settings.local_prefill_max_tokens)
    except GatewayError as exc:
        cause = exc.__cause__
        if not (isinstance(cause, grpc.aio.AioRpcError) and cause.code() == FAILED_PRECONDITION):
            raise
        gen.held.nothing_started()
        gen.p.router.on_local_prefill_refused(address, gen.prefix_hashes)
        outcomes.labels(metrics.model_name, "refused").inc()
        logger.debug("request %s: no local prefill on %s: %s", gen.request_id, address, exc.message)
        return None
    outcomes.labels(metrics.model_name, "served").inc()
    return step


async def _decode_whole(gen: Generation, address: str, max_uncached_tokens: int) -> Step:
    """A Decode without state on `address`: the worker computes the prompt (all but at most
    `max_uncached_tokens` of it cached there; 0: no limit) and streams every token; the first
    step."""
    request = decode_pb2.DecodeRequest(
        request_id=gen.request_id,
        prompt_token_ids=gen.prompt_ids,
        sampling_params=sampling_params_to_proto(gen.params),
        output_token_ids=gen.resumed_ids,  # after a decode failover: it continues from these
        max_uncached_tokens=max_uncached_tokens,
        prefix_hashes=gen.prefix_hashes,
    )
    for _ in range(gen.params.num_samples):  # it takes a slot there per sample, as a reservation would
        gen.p.router.on_decode_reserved(address)
    gen.held.hold_stream(address, gen.p.clients.decode(address, request, gen.remaining_s()))
    step = await gen._first_streamed()  # a group's shared prefill reads it its own way
    first_of_request = not gen.resumed_ids
    computed_here = first_of_request and gen.held.prefill_address is None
    hit = (len(gen.prompt_ids), gen.num_cached_tokens) if computed_here else None
    gen.observed.prompt_streamed(observe_ttft=first_of_request, prefix_hit=hit)
    return step
