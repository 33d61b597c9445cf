"""One prompt's trip through the workers: Reserve → Prefill → Decode stream → steps.

Each worker message becomes a client-visible `Step` in `frontend.steps` (detokenized, stop
strings applied).

`Generation` owns every resource the request holds on a worker. Its caller runs
`start()` then `next()` until a step carries a finish reason, and calls `release()` in a
`finally` whatever happened: release aborts what is still held (the reservation, a prefill in
flight, a decode stream) and is shielded from cancellation, so a client that disconnects
frees everything on the workers.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import grpc

from frontend.backoff import Backoff
from frontend.clients import DecodeStream, WorkerClients
from frontend.errors import GatewayError, over_capacity, unavailable
from frontend.failover import METHOD_REPREFILL, METHOD_STORED, DecodeFailover, WorkerLost, read_delta
from frontend.metrics import GatewayMetrics
from frontend.prefix_metrics import PrefixMetrics
from frontend.router import Router
from frontend.settings import GatewaySettings
from frontend.steps import OutputSteps, Step
from splitserve.prefix_hash import grow_chain
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import Tokenizer
from splitserve.v1 import common_pb2, decode_pb2, prefill_pb2
from splitserve.wire import FINISH_FROM_PROTO, decode_request, prefill_request, sampling_params_to_proto

if TYPE_CHECKING:
    from frontend.samples import SampleGroup

logger = logging.getLogger(__name__)

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION  # a decode worker refusing a local prefill
# A prompt whose prefill failed for want of its worker or that worker's store (503) is tried
# again on another prefill worker or through prefill.fallback, at most this many times.
MAX_PREFILL_RETRIES = 2


class DecodeUnreachable(GatewayError):
    """No decode worker could be reached for a reservation (the pool's workers are dead or being
    restarted): the request may wait for one (`decode_failover_wait_s`)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, code="service_unavailable")


class PrefillLost(GatewayError):
    """A prefill failed because its worker, or the store it writes to, could not be reached:
    nothing reached the client yet, so the prompt may run elsewhere."""

    def __init__(self, address: str, cause: GatewayError) -> None:
        super().__init__(cause.status_code, cause.message, code=cause.code)
        self.address = address


async def _always_reachable(address: str) -> bool:
    return True


@dataclass
class Pipeline:
    """Everything a generation needs from the gateway; built once per app."""

    settings: GatewaySettings
    router: Router
    clients: WorkerClients
    metrics: GatewayMetrics
    tokenizer: Tokenizer | None
    on_route: Callable[[str], None] = field(default=lambda store_address: None)
    prefix_metrics: PrefixMetrics | None = None
    # asks one worker at once whether it answers, marking it in the router (LoadMonitor.probe)
    probe: Callable[[str], Awaitable[bool]] = field(default=_always_reachable)

    def prefix_hashes(self, prompt_ids: list[int]) -> list[bytes]:
        """The prompt's prefix chain, salted with the served model name; empty with caching off."""
        return self.grown_prefix_hashes([], prompt_ids)

    def grown_prefix_hashes(self, chain: list[bytes], token_ids: list[int]) -> list[bytes]:
        """`chain` (of the first units of `token_ids`) grown over all of them; empty with caching off."""
        if not self.settings.enable_prefix_caching:
            return []
        salt = self.settings.model_name.encode()
        return grow_chain(chain, token_ids, self.settings.prefix_unit, salt)


class Generation:
    """One prompt, one choice. Not reusable; not safe to drive from two tasks at once.

    A sample of a request of several (`group`, frontend/samples.py) gets its first step from
    the group's one prefill and reads its part of the group's one decode stream; from then on
    (a failover included: it re-prefills as a request of its own, seeded seed + index) it is an
    ordinary generation. Its prompt counts once per request (`bills_prompt`: sample 0's)."""

    def __init__(
        self,
        pipeline: Pipeline,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
        *,
        prefix_hashes: list[bytes] | None = None,
        sample_index: int = 0,
        group: SampleGroup | None = None,
        counted: bool = True,
    ) -> None:
        self.p = pipeline
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        # once per prompt
        self.prefix_hashes = pipeline.prefix_hashes(prompt_ids) if prefix_hashes is None else prefix_hashes
        self.num_cached_tokens = 0  # prompt tokens the prefill served from a prefix cache
        self.sample_index = sample_index
        self._group = group
        self._counted = counted  # a choice the metrics count (not a group's shared prefill)
        self.params = params
        self.arrival_s = arrival_s
        self.deadline_s = arrival_s + pipeline.settings.request_timeout_s
        self._output = OutputSteps(pipeline.tokenizer, prompt_ids, params)
        self._decode_address: str | None = None
        self._prefill_address: str | None = None
        self._holds_reservation = False
        # (store address, key) of the state the decode worker reads and then frees: freed here
        # instead when that worker is lost before it could (a failover that re-prefills)
        self._handoff: tuple[str, str] | None = None
        self._reserve_in_flight: asyncio.Future[decode_pb2.ReserveResponse] | None = None
        self._prefill_in_flight = False
        self._stream: DecodeStream | None = None
        self._failover = DecodeFailover(pipeline.settings, pipeline.metrics)
        self._resumed: list[int] = []  # after a decode failover: the tokens received before it
        self._resume_from: decode_pb2.ResumeFrom | None = None  # where the decode worker keeps our state
        self.resume_method = METHOD_REPREFILL
        self._last_token_s = arrival_s
        self._has_first_token = False  # whether a token reached this gateway (ITL counts gaps after it)
        self._transfer_s = 0.0
        self._released = False
        if counted:
            pipeline.metrics.running.labels(pipeline.metrics.model_name).inc()

    @property
    def num_generated_tokens(self) -> int:
        return self._output.num_generated_tokens

    @property
    def finish_reason(self) -> str | None:
        return self._output.finish_reason

    @property
    def bills_prompt(self) -> bool:
        """Whether usage counts this choice's prompt (and cached) tokens: once per prompt."""
        return self.sample_index == 0

    # The flow ---------------------------------------------------------------------------------

    async def start(self) -> Step:
        """Reserve a decode slot, run the prefill; the first step (maybe already final).

        A prefill that fails because its worker or that worker's store cannot be reached (it
        died, its store is restarting) is run again, the room it held given back first: on
        another prefill worker, else through `prefill.fallback` (`decode_local`: the decode
        worker computes the prompt, no store needed). Nothing reached the client yet, so the
        client sees one answer, with the tokens an unbroken run gives."""
        if self._group is not None and not self._group.began(self):
            return await self._group.first_step(self)  # the group's one prefill, then its part
        failed: list[str] = []
        backoff = Backoff(min(self.deadline_s, time.monotonic() + self.p.settings.decode_failover_wait_s))
        while True:
            try:
                return await self._start(failed)
            except DecodeUnreachable:
                await self._release_decode()
                if not await backoff.wait():  # none came back in time: the 503 stands
                    raise
            except PrefillLost as lost:
                failed.append(lost.address)
                await self._release_decode()
                if len(failed) > MAX_PREFILL_RETRIES:
                    raise
                reachable = await self.p.probe(lost.address)
                logger.warning(
                    "request %s: prefill on %s failed (%s; the worker %s); running the prompt elsewhere",
                    self.request_id,
                    lost.address,
                    lost.message,
                    "answers" if reachable else "is unreachable",
                )
                self.p.metrics.prefill_retries.labels(self.p.metrics.model_name).inc()

    async def _start(self, failed_prefill: list[str]) -> Step:
        """One try of `start`, on a prefill worker not in `failed_prefill` (or none)."""
        num_prompt_tokens = len(self.prompt_ids)
        prefill_address = self.p.router.pick_prefill(num_prompt_tokens, self.prefix_hashes, failed_prefill)
        decode_candidates = self.p.router.rank_decode(
            num_prompt_tokens, self.params.max_tokens or 0, self.prefix_hashes, near=prefill_address
        )
        if not decode_candidates:
            listed = self.p.router.decode_addresses
            if not listed:
                raise unavailable("no decode workers are available; try again later")
            raise DecodeUnreachable(_no_decode_worker(listed, self.p.router.unreachable()))
        if prefill_address is None:
            return await self._start_on_decode(decode_candidates[0], failed_prefill)
        local = self._local_prefill_target(decode_candidates)
        if local is not None:
            step = await self._start_local(local)
            if step is not None:
                return step
        source_store = self.p.router.store_of(prefill_address)
        if self.params.max_tokens == 1:
            # One token is all the prefill makes: no decode room to reserve, nor an Abort to free it.
            response = await self._prefill(prefill_address, None)
        elif self._may_reserve_alongside(decode_candidates, source_store):
            response = await self._prefill_while_reserving(prefill_address, decode_candidates, source_store)
        else:
            reservation = await self._reserve(decode_candidates, source_store)
            if self._decode_address in self.p.router.prefill_addresses:
                prefill_address = self._decode_address  # colocated: the engine holding the room prefills
            response = await self._prefill(prefill_address, reservation)
        self._observe_prefill(response)
        return await self._begin(response)

    async def _begin(self, response: prefill_pb2.PrefillResponse) -> Step:
        """The first step from a prefill's answer; the decode stream opened, or the room given back."""
        step = self._output.step(
            [response.first_token_id],
            [response.first_logprobs] if response.HasField("first_logprobs") else [],
            FINISH_FROM_PROTO.get(response.finish_reason),
            response.stop_token_id if response.HasField("stop_token_id") else None,
        )
        self._note_first_token()
        if step.finish_reason is None:
            self._open_decode(response)
        else:
            await self._release_decode()
        return step

    def _note_first_token(self) -> None:
        """A first token reached the gateway: the TTFT (unless a failover's), and the ITL's start."""
        now = time.monotonic()
        if not self._resumed:  # after a failover this is not the request's first token
            self.p.metrics.ttft.labels(self.p.metrics.model_name).observe(now - self.arrival_s)
        self._last_token_s, self._has_first_token = now, True

    def take_first(self, start: common_pb2.SampleStart) -> Step:
        """A sample's first step, from the first token its group's prefill drew for it."""
        self._last_token_s, self._has_first_token = time.monotonic(), True
        return self._output.step(
            [start.token_id],
            [start.logprobs] if start.HasField("logprobs") else [],
            FINISH_FROM_PROTO.get(start.finish_reason),
            start.stop_token_id if start.HasField("stop_token_id") else None,
        )

    def attach_stream(self, stream: DecodeStream, address: str) -> None:
        """A sample reads its part of its group's decode stream, on decode worker `address`."""
        self._stream, self._decode_address = stream, address

    async def next(self) -> Step:
        """The next decode step. A lost decode worker fails over (frontend.failover); raises
        GatewayError when the stream breaks otherwise, or failover is off or fails."""
        assert self._stream is not None and self.finish_reason is None, "next() after the last step"
        try:
            delta = await read_delta(self._stream)
        except WorkerLost as lost:
            return await self._failover.recover(self, lost, self.deadline_s)
        return await self._take(delta)

    async def _take(self, delta: decode_pb2.TokenDelta) -> Step:
        """One delta of the decode stream as a step (metrics observed, stop strings applied)."""
        if delta.HasField("resume_from"):
            self._resume_from = delta.resume_from
        if delta.num_cached_tokens:  # the first delta of a Decode that computed the prompt
            self.num_cached_tokens = delta.num_cached_tokens
        now = time.monotonic()
        if delta.token_ids:
            if self._has_first_token:  # a Decode without state streams the first token too: no gap
                gap_s = (now - self._last_token_s) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.p.metrics.itl.labels(self.p.metrics.model_name).observe(gap_s)
            self._has_first_token = True
            self._last_token_s = now
        if delta.HasField("timing") and (delta.timing.queue_s or delta.timing.state_wait_s):
            self.p.metrics.queue.labels(self.p.metrics.model_name, "decode").observe(delta.timing.queue_s)
            self.p.metrics.transfer_s.labels(self.p.metrics.model_name).observe(
                self._transfer_s + delta.timing.state_wait_s
            )
        step = self._output.step(
            list(delta.token_ids),
            list(delta.logprobs),
            FINISH_FROM_PROTO.get(delta.finish_reason),
            delta.stop_token_id if delta.HasField("stop_token_id") else None,
        )
        if step.finish_reason is not None:
            if delta.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                await self._release_decode()  # a stop string ended it here, not on the worker
            else:
                self._note_retained_end()
            self._stream = None
        return step

    def _note_retained_end(self) -> None:
        """The decode worker finished the request and keeps everything it computed (prompt and
        reply but the last token) as a prefix hit: the router learns it, so the conversation's
        next turn, which re-sends it, can be prefilled there (`router.local_prefill_max_tokens`)."""
        if not self.p.settings.local_prefill_max_tokens or self._decode_address is None:
            return
        history = self.prompt_ids + self._output.received_ids
        num_kept = len(history) - 1  # the last token was sampled, never computed
        chain = self.p.grown_prefix_hashes(self.prefix_hashes, history[:num_kept])
        if chain:
            self.p.router.on_decode_retained(self._decode_address, chain[-1], num_kept)

    async def resume_elsewhere(self) -> Step:
        """Decode failover: drop the lost stream (its worker is gone: nothing to abort there) and
        route again; the prefill runs prompt + every token received, the next step comes back."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
        await self._release_decode()  # a room an earlier failed attempt still holds
        handoff, self._handoff = self._handoff, None
        if handoff is not None and self._resume_from is None:  # the lost worker may not have freed it
            with anyio.CancelScope(shield=True):
                await self._quietly(self.p.clients.release_state(*handoff))
        self._resumed = list(self._output.received_ids)
        lost = stream.address if stream is not None else None
        if self._resume_from is not None:  # kept over attempts that found no worker to ask
            self.resume_method = METHOD_STORED
            step = await self._resume_from_store(self._resume_from, lost)
            if step is not None:
                return step
            self._resume_from = None  # refused: re-prefill from here on
        self.resume_method = METHOD_REPREFILL
        return await self.start()

    async def _resume_from_store(self, where: decode_pb2.ResumeFrom, lost: str | None) -> Step | None:
        """Decode failover from stored state (frontend.failover): a Decode with `resume_from` on
        the first decode worker that answers; its first step, or None (counted) when the state
        cannot be used, and the caller re-prefills. A 503 when no worker answered (the failover
        backs off and tries again)."""
        request = decode_pb2.DecodeRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            sampling_params=sampling_params_to_proto(self.params),
            output_token_ids=self._resumed,
            resume_from=where,
        )
        num_tokens = len(self.prompt_ids) + len(self._resumed)
        candidates = self.p.router.rank_decode(num_tokens, self.params.max_tokens or 0, self.prefix_hashes)
        for address in [a for a in candidates if a != lost]:
            self._decode_address = address
            self._stream = self.p.clients.decode(address, request, self._remaining_s())
            self.p.router.on_decode_reserved(address)
            try:
                delta = await read_delta(self._stream)
            except GatewayError as exc:  # the worker holds nothing of it: no Abort to send
                self._stream.cancel()
                self._stream = None
                if isinstance(exc, WorkerLost):
                    continue  # that worker is unreachable too: the next one
                logger.info("request %s: not resumed from stored state: %s", self.request_id, exc.message)
                break
            self._resume_from = None  # the new stream's first delta names the new place
            return await self._take(delta)
        else:
            raise unavailable("no decode worker could be reached to resume from the stored state")
        self._failover.stored_state_failed()
        return None

    async def release(self, error: bool = False) -> None:
        """Abort whatever this request still holds on any worker; idempotent, never raises."""
        if self._released:
            return
        self._released = True
        # Metrics first: once a worker sees the abort, the request is already counted.
        reason = self.finish_reason or ("error" if error else "abort")
        metrics = self.p.metrics
        if self._counted:
            metrics.running.labels(metrics.model_name).dec()
        # Only work a worker was given counts as processed: a request refused before any prefill
        # (429, 503) is counted apart, by reason, where its error is answered (frontend.errors).
        if self._counted and (self._prefill_address is not None or self.num_generated_tokens > 0):
            num_prompt = len(self.prompt_ids) if self.bills_prompt else 0
            metrics.observe_finished(reason, num_prompt, self.num_generated_tokens)
        if self._counted and self.finish_reason is not None:
            metrics.e2e.labels(metrics.model_name).observe(time.monotonic() - self.arrival_s)
        with anyio.CancelScope(shield=True):
            if self._reserve_in_flight is not None:  # cancelled mid-Reserve: its answer first
                await asyncio.gather(self._reserve_in_flight, return_exceptions=True)
                self._holds_reservation = True  # an Abort of a room never granted is harmless
            if self._prefill_in_flight and self._prefill_address is not None:
                await self._quietly(self.p.clients.abort_prefill(self._prefill_address, self.request_id))
            await self._release_decode()
            if self._group is not None:  # the last sample out releases the group's prefill
                await self._group.release(self, error)

    # Pieces -----------------------------------------------------------------------------------

    async def _start_on_decode(self, address: str, failed_prefill: Sequence[str] = ()) -> Step:
        """No prefill worker can take the prompt (the pool is empty or unreachable, or the ones
        left failed it): with `prefill.fallback: decode_local` the decode worker computes the
        prompt itself (a Decode without state) and streams every token; else 503."""
        policy = self.p.settings.prefill_fallback
        self.p.metrics.prefill_fallbacks.labels(self.p.metrics.model_name, policy).inc()
        if policy != "decode_local":
            why = "has no worker" if not self.p.router.prefill_addresses else "has no worker that can take it"
            if failed_prefill:
                why += f" (failed on {', '.join(failed_prefill)})"
            raise unavailable(f"the prefill pool {why}; prefill.fallback is fail: retry later")
        return await self._decode_whole(address, max_uncached_tokens=0)

    def _local_prefill_target(self, candidates: list[str]) -> str | None:
        """The decode worker to prefill this prompt itself (`router.local_prefill_max_tokens`):
        among the candidates believed to have room, the one believed to hold the longest prefix
        of it, if at most the limit of its tokens is left to compute there. None: a prefill
        worker computes it (the limit is 0, a failover re-prefill, or a colocated pool)."""
        limit = self.p.settings.local_prefill_max_tokens
        if not limit or self._resumed:
            return None
        if any(address in self.p.router.prefill_addresses for address in candidates):
            return None
        matched = self.p.router.decode_prefix_match(self.prefix_hashes)
        num_prompt_tokens = len(self.prompt_ids)
        fits = [
            address
            for address in candidates
            if num_prompt_tokens - matched.get(address, 0) <= limit and self.p.router.decode_has_room(address)
        ]
        return max(fits, key=lambda address: matched.get(address, 0), default=None)

    async def _start_local(self, address: str) -> Step | None:
        """A local prefill on decode worker `address`: its first step, or None when the worker
        holds less of the prompt than believed (it started nothing; counted) and a prefill
        worker must compute it."""
        outcomes = self.p.metrics.local_prefills
        try:
            step = await self._decode_whole(address, self.p.settings.local_prefill_max_tokens)
        except GatewayError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, grpc.aio.AioRpcError) and cause.code() == FAILED_PRECONDITION):
                raise
            self._stream, self._decode_address = None, None  # nothing was started there
            self.p.router.on_local_prefill_refused(address, self.prefix_hashes)
            outcomes.labels(self.p.metrics.model_name, "refused").inc()
            logger.debug("request %s: no local prefill on %s: %s", self.request_id, address, exc.message)
            return None
        outcomes.labels(self.p.metrics.model_name, "served").inc()
        return step

    async def _decode_whole(self, address: str, max_uncached_tokens: int) -> Step:
        """A Decode without state on `address`: the worker computes the prompt (all but at most
        `max_uncached_tokens` of it cached there; 0: no limit) and streams every token; the first
        step."""
        request = decode_pb2.DecodeRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            sampling_params=sampling_params_to_proto(self.params),
            output_token_ids=self._resumed,  # after a decode failover: it continues from these
            max_uncached_tokens=max_uncached_tokens,
            prefix_hashes=self.prefix_hashes,
        )
        self._decode_address = address
        for _ in range(self.params.num_samples):  # it takes a slot there per sample, as a reservation would
            self.p.router.on_decode_reserved(address)
        self._stream = self.p.clients.decode(address, request, self._remaining_s())
        step = await self._first_streamed()
        self._last_token_s = now = time.monotonic()
        if not self._resumed:
            self.p.metrics.ttft.labels(self.p.metrics.model_name).observe(now - self.arrival_s)
            if self.p.prefix_metrics is not None and self._prefill_address is None:
                self.p.prefix_metrics.observe_prefill(len(self.prompt_ids), self.num_cached_tokens)
        return step

    async def _first_streamed(self) -> Step:
        """The first step of a Decode without state (the worker computes the prompt)."""
        return await self.next()

    async def _reserve_on(
        self, address: str, request: decode_pb2.ReserveRequest
    ) -> decode_pb2.ReserveResponse:
        """One Reserve. Cancelled while in flight (a sibling prompt failed, the client left), the
        call still runs to its answer, so release() aborts a room the worker granted instead of
        leaving it held until it lapses (2 x reserve_timeout_s)."""
        call = asyncio.ensure_future(self.p.clients.reserve(address, request))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._decode_address, self._reserve_in_flight = address, call
            raise

    def _may_reserve_alongside(self, candidates: list[str], source_store: str) -> bool:
        """Whether the prefill may start before the reservation is granted: the prefill's node
        store is known (the key can be named here), no candidate prefills itself (a colocated
        worker must hold the room first) and the first candidate is believed to have room (so a
        full decode pool refuses requests before their prefill, not after)."""
        if not source_store:
            return False
        if any(address in self.p.router.prefill_addresses for address in candidates):
            return False
        return self.p.router.decode_has_room(candidates[0])

    async def _prefill_while_reserving(
        self, prefill_address: str, candidates: list[str], source_store: str
    ) -> prefill_pb2.PrefillResponse:
        """The prefill starts at once, writing into its own node's store under a key named here
        (one per attempt); the reservation runs beside it, so its round trip (and, on a busy
        decode worker, its wait for the engine's step) leaves the TTFT. A reservation refused
        everywhere aborts the prefill, releases the key in the store and answers as before
        (429/503)."""
        key = f"decode/{self.request_id}/{secrets.token_hex(8)}"  # shaped like a decode worker's own
        # the prefill records itself as the state's owner: the writer until the decode reads it
        target = decode_pb2.ReserveResponse(accepted=True, store_address=source_store, state_key=key)
        prefilling = asyncio.ensure_future(self._prefill(prefill_address, target))
        try:
            await self._reserve(candidates, source_store, key)
        except BaseException:
            prefilling.cancel()  # release() aborts it on the worker (it is still in flight)
            await asyncio.gather(prefilling, return_exceptions=True)
            with anyio.CancelScope(shield=True):
                # nobody will read it: free what was written (sealed or not); a write still on
                # its way is refused from now on, so nothing waits for the lease to run out
                await self._quietly(self.p.clients.release_state(source_store, key))
            raise
        return await prefilling

    async def _reserve(
        self, candidates: list[str], source_store: str = "", state_key: str = ""
    ) -> decode_pb2.ReserveResponse:
        """Reserve room on the first candidate that grants it. The state goes to `source_store`
        (the prefill worker's node store: it writes there, the decode reads from there, one hop);
        "" leaves it to the decode worker's own store, as for a colocated worker. `state_key`:
        the key a prefill already running writes under ("" lets the decode worker name it)."""
        request = decode_pb2.ReserveRequest(
            request_id=self.request_id,
            num_prompt_tokens=len(self.prompt_ids) + len(self._resumed),  # the state's tokens
            timeout_s=self.p.settings.reserve_timeout_s,
            state_key=state_key,
            num_samples=self.params.num_samples,
        )
        if self.params.max_tokens is not None:
            request.max_tokens = self.params.max_tokens
        rejections: list[str] = []
        failures: list[str] = []
        for address in candidates:
            colocated = address in self.p.router.prefill_addresses  # it prefills into its own store
            request.source_store_address = "" if colocated else source_store
            try:
                response = await self._reserve_on(address, request)
            except GatewayError as exc:
                if exc.status_code != 503:
                    raise
                failures.append(exc.message)
                await self.p.probe(address)  # unreachable: not ranked again until it answers
                continue
            if response.accepted:
                self._decode_address = address
                self._holds_reservation = True
                self._handoff = (response.store_address, response.state_key)
                for _ in range(self.params.num_samples):
                    self.p.router.on_decode_reserved(address)
                self.p.on_route(response.store_address)
                return response
            rejections.append(f"{address}: {response.reject_reason or 'rejected'}")
        if rejections:
            raise over_capacity("every decode worker is full (" + "; ".join(rejections) + "); retry later")
        raise DecodeUnreachable("no decode worker could be reached: " + "; ".join(failures))

    async def _prefill(
        self, address: str, reservation: decode_pb2.ReserveResponse | None
    ) -> prefill_pb2.PrefillResponse:
        request = prefill_request(
            self.request_id,
            self.prompt_ids,
            sampling_params_to_proto(self.params),
            reservation,
            self.p.settings.state_lease_s,
            self.prefix_hashes,
        )
        request.output_token_ids.extend(self._resumed)
        self._prefill_address = address
        self._prefill_in_flight = True
        self.p.router.on_prefill_start(address, len(self.prompt_ids))
        self.p.router.on_prefix_sent(address, self.prefix_hashes)
        try:
            response = await self.p.clients.prefill(address, request, self._remaining_s())
            self._prefill_in_flight = False
            return response
        except GatewayError as exc:
            self._prefill_in_flight = False  # it failed there: nothing to abort
            cause = exc.__cause__  # UNAVAILABLE: the worker or its store unreachable (a crash
            # of the worker on this prompt is UNKNOWN or INTERNAL, and would crash elsewhere too)
            if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE:
                raise PrefillLost(address, exc) from exc
            raise
        finally:
            self.p.router.on_prefill_end(address, len(self.prompt_ids))

    def _observe_prefill(self, response: prefill_pb2.PrefillResponse) -> None:
        self.num_cached_tokens = response.num_cached_tokens
        if self.p.prefix_metrics is not None:
            self.p.prefix_metrics.observe_prefill(len(self.prompt_ids), response.num_cached_tokens)
        timing = response.timing
        metrics = self.p.metrics
        metrics.queue.labels(metrics.model_name, "prefill").observe(timing.queue_s)
        if timing.state_bytes:
            metrics.transfer_bytes.labels(metrics.model_name).observe(timing.state_bytes)
            metrics.transfer_stream_s.labels(metrics.model_name).observe(timing.state_stream_s)
        self._transfer_s = timing.state_put_s  # the decode's wait for the state is added to it

    def _open_decode(self, response: prefill_pb2.PrefillResponse) -> None:
        """Hand the prefilled request to its reserved decode worker: the reservation becomes a stream."""
        request = decode_request(
            self.request_id, self.prompt_ids, sampling_params_to_proto(self.params), response
        )
        request.output_token_ids.extend(self._resumed)
        assert self._decode_address is not None
        self._stream = self.p.clients.decode(self._decode_address, request, self._remaining_s())
        self._holds_reservation = False

    async def _release_decode(self) -> None:
        """Abort the reservation or the decode stream, if either is still held."""
        stream, self._stream = self._stream, None
        held = self._holds_reservation or stream is not None
        self._holds_reservation = False
        if stream is not None:
            stream.cancel()
        if held and self._decode_address is not None:
            with anyio.CancelScope(shield=True):
                await self._quietly(self.p.clients.abort_decode(self._decode_address, self.request_id))

    async def _quietly(self, call: object) -> None:
        try:
            await call  # type: ignore[misc]
        except GatewayError as exc:
            logger.warning("request %s: cleanup failed: %s", self.request_id, exc.message)

    def _remaining_s(self) -> float:
        remaining = self.deadline_s - time.monotonic()
        if remaining <= 0:
            raise GatewayError(503, f"request timed out after {self.p.settings.request_timeout_s:g} s")
        return remaining


def _no_decode_worker(listed: tuple[str, ...], unreachable: dict[str, str]) -> str:
    """Why none of the `listed` decode workers can be tried, for a 503."""
    down = "; ".join(f"{a}: {unreachable[a]}" for a in listed if a in unreachable)
    return f"no decode worker can be reached ({down}); try again later"
