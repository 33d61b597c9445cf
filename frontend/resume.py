"""Going on elsewhere after a decode worker was lost: from its stored state, else by re-prefill.

`DecodeFailover` (frontend/failover.py) decides whether and how often a generation may fail
over; this is one try of it. The lost stream is dropped (its worker is gone: nothing to abort
there), and the generation goes on with every token it received (`Generation.resumed_ids`):
from the state the lost worker kept in its node's store (`Generation.resume_from`, named in its
stream's first delta, `decode.replay_window` > 0) on the first decode worker that answers, else
routed again as a new prompt whose prefill runs prompt + those tokens.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from frontend.errors import GatewayError, unavailable
from frontend.failover import METHOD_REPREFILL, METHOD_STORED, WorkerLost, read_delta
from frontend.steps import Step
from splitserve.v1 import decode_pb2
from splitserve.wire import sampling_params_to_proto

if TYPE_CHECKING:
    from frontend.generate import Generation

logger = logging.getLogger(__name__)


async def resume_elsewhere(gen: Generation) -> Step:
    """Drop the lost stream and route again; the next step. From stored state when the lost
    worker named where it kept it, else (or when that state cannot be used) the prefill runs
    prompt + every token received. Sets `gen.resume_method` to the way it went on."""
    # the handoff's state is freed here unless the lost worker had read it (it then named
    # where it keeps the request's state)
    lost = await gen.held.drop_lost_decode(free_handoff=gen.resume_from is None)
    gen.resumed_ids = list(gen.received_ids)
    if gen.resume_from is not None:  # kept over attempts that found no worker to ask
        gen.resume_method = METHOD_STORED
        step = await _resume_from_store(gen, gen.resume_from, lost)
        if step is not None:
            return step
        gen.resume_from = None  # refused: re-prefill from here on
    gen.resume_method = METHOD_REPREFILL
    return await gen.start()


async def _resume_from_store(gen: Generation, where: decode_pb2.ResumeFrom, lost: str | None) -> Step | None:
    """A Decode with `resume_from` on the first decode worker that answers; its first step, or
    None (counted) when the state cannot be used, and the caller re-prefills. A 503 when no
    worker answered (the failover backs off and tries again)."""
    request = decode_pb2.DecodeRequest(
        request_id=gen.request_id,
        prompt_token_ids=gen.prompt_ids,
        sampling_params=sampling_params_to_proto(gen.params),
        output_token_ids=gen.resumed_ids,
        resume_from=where,
    )
    num_tokens = len(gen.prompt_ids) + len(gen.resumed_ids)
    candidates = gen.p.router.rank_decode(num_tokens, gen.params.max_tokens or 0, gen.prefix_hashes)
    for address in [a for a in candidates if a != lost]:
        stream = gen.p.clients.decode(address, request, gen.remaining_s())
        gen.held.hold_stream(address, stream)
        gen.p.router.on_decode_reserved(address)
        try:
            delta = await read_delta(stream)
        except GatewayError as exc:  # the worker holds nothing of it: no Abort to send
            gen.held.drop_stream()
            if isinstance(exc, WorkerLost):
                continue  # that worker is unreachable too: the next one
            logger.info("request %s: not resumed from stored state: %s", gen.request_id, exc.message)
            break
        gen.resume_from = None  # the new stream's first delta names the new place
        return await gen.take_delta(delta)
    else:
        raise unavailable("no decode worker could be reached to resume from the stored state")
    gen.failover.stored_state_failed()
    return None
