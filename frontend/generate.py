"""One prompt's trip through the workers: Reserve → Prefill → Decode stream → steps.

Each worker message becomes a client-visible `Step` in `frontend.steps` (detokenized, stop
strings applied).

`Generation` composes the pieces: how the prompt starts (`frontend.start`: disaggregated in
`frontend.disaggregated`, on a decode worker in `frontend.local_start`), how it goes on after a
lost decode worker (`frontend.resume`), what it holds on workers (`frontend.holdings`) and what
it reports (`frontend.generation_metrics`). Its caller runs `start()` then `next()` until a step
carries a finish reason, and calls `release()` in a `finally` whatever happened: release aborts
what is still held (the reservation, a prefill in flight, a decode stream) and is shielded from
cancellation, so a client that disconnects frees everything on the workers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio

from frontend.clients import DecodeStream
from frontend.errors import GatewayError
from frontend.failover import METHOD_REPREFILL, DecodeFailover, WorkerLost, read_delta
from frontend.generation_metrics import GenerationMetrics
from frontend.holdings import Holdings
from frontend.pipeline import Pipeline
from frontend.resume import resume_elsewhere
from frontend.start import start
from frontend.steps import OutputSteps, Step
from splitserve.sampling_params import SamplingParams
from splitserve.v1 import common_pb2, decode_pb2, prefill_pb2
from splitserve.wire import FINISH_FROM_PROTO, decode_request, sampling_params_to_proto

if TYPE_CHECKING:
    from frontend.samples import SampleGroup

__all__ = ["Generation", "Pipeline"]


class Generation:
    """One prompt, one choice. Not reusable; not safe to drive from two tasks at once.

    Owns the choice's output (`OutputSteps`), what it holds on workers (`held`), its metrics
    (`observed`), its failovers (`failover`) and what a failover resumes from (`resumed_ids`,
    `resume_from`, written by frontend.resume). Promises: every step a client sees comes in
    order, none repeated or missing across failovers; `release` frees everything held.

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
        self.params = params
        self.arrival_s = arrival_s
        self.deadline_s = arrival_s + pipeline.settings.request_timeout_s
        self.held = Holdings(pipeline.clients, request_id)
        # counted: a choice the metrics count (not a group's shared prefill)
        self.observed = GenerationMetrics(pipeline.metrics, pipeline.prefix_metrics, arrival_s, counted)
        self.failover = DecodeFailover(pipeline.settings, pipeline.metrics)
        self._output = OutputSteps(pipeline.tokenizer, prompt_ids, params)
        self.resumed_ids: list[int] = []  # after a decode failover: the tokens received before it
        self.resume_from: decode_pb2.ResumeFrom | None = None  # where the decode worker keeps our state
        self.resume_method = METHOD_REPREFILL
        self._released = False

    @property
    def num_generated_tokens(self) -> int:
        return self._output.num_generated_tokens

    @property
    def received_ids(self) -> list[int]:
        """Every token id a worker generated for this choice (what a failover resumes from)."""
        return self._output.received_ids

    @property
    def finish_reason(self) -> str | None:
        return self._output.finish_reason

    @property
    def bills_prompt(self) -> bool:
        """Whether usage counts this choice's prompt (and cached) tokens: once per prompt."""
        return self.sample_index == 0

    # The flow ---------------------------------------------------------------------------------

    async def start(self) -> Step:
        """Reserve a decode slot, run the prefill; the first step (maybe already final). A
        prefill lost with its worker or store runs again elsewhere (frontend.start)."""
        if self._group is not None and not self._group.began(self):
            return await self._group.first_step(self)  # the group's one prefill, then its part
        return await start(self)

    async def prefilled(self, response: prefill_pb2.PrefillResponse) -> Step:
        """The first step from a prefill's answer, its figures observed."""
        self.num_cached_tokens = response.num_cached_tokens
        self.observed.prefilled(response, len(self.prompt_ids))
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
            await self.held.release_decode()
        return step

    def _note_first_token(self) -> None:
        """A first token reached the gateway: the TTFT (unless a failover's), and the ITL's start."""
        self.observed.first_token(observe_ttft=not self.resumed_ids)

    def take_first(self, start: common_pb2.SampleStart) -> Step:
        """A sample's first step, from the first token its group's prefill drew for it."""
        self.observed.first_token(observe_ttft=False)
        return self._output.step(
            [start.token_id],
            [start.logprobs] if start.HasField("logprobs") else [],
            FINISH_FROM_PROTO.get(start.finish_reason),
            start.stop_token_id if start.HasField("stop_token_id") else None,
        )

    def attach_stream(self, stream: DecodeStream, address: str) -> None:
        """A sample reads its part of its group's decode stream, on decode worker `address`."""
        self.held.hold_stream(address, stream)

    async def next(self) -> Step:
        """The next decode step. A lost decode worker fails over (frontend.failover); raises
        GatewayError when the stream breaks otherwise, or failover is off or fails."""
        stream = self.held.stream
        assert stream is not None and self.finish_reason is None, "next() after the last step"
        try:
            delta = await read_delta(stream)
        except WorkerLost as lost:
            return await self.failover.recover(self, lost, self.deadline_s)
        return await self.take_delta(delta)

    async def _first_streamed(self) -> Step:
        """The first step of a Decode without state (the worker computes the prompt)."""
        return await self.next()

    async def take_delta(self, delta: decode_pb2.TokenDelta) -> Step:
        """One delta of the decode stream as a step (metrics observed, stop strings applied)."""
        if delta.HasField("resume_from"):
            self.resume_from = delta.resume_from
        if delta.num_cached_tokens:  # the first delta of a Decode that computed the prompt
            self.num_cached_tokens = delta.num_cached_tokens
        self.observed.delta(delta)
        step = self._output.step(
            list(delta.token_ids),
            list(delta.logprobs),
            FINISH_FROM_PROTO.get(delta.finish_reason),
            delta.stop_token_id if delta.HasField("stop_token_id") else None,
        )
        if step.finish_reason is not None:
            if delta.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                await self.held.release_decode()  # a stop string ended it here, not on the worker
            else:
                self._note_retained_end()
            self.held.stream = None  # the call ended (or was just cancelled)
        return step

    def _note_retained_end(self) -> None:
        """The decode worker finished the request and keeps everything it computed (prompt and
        reply but the last token) as a prefix hit: the router learns it, so the conversation's
        next turn, which re-sends it, can be prefilled there (`router.local_prefill_max_tokens`)."""
        address = self.held.decode_address
        if not self.p.settings.local_prefill_max_tokens or address is None:
            return
        history = self.prompt_ids + self.received_ids
        num_kept = len(history) - 1  # the last token was sampled, never computed
        chain = self.p.grown_prefix_hashes(self.prefix_hashes, history[:num_kept])
        if chain:
            self.p.router.on_decode_retained(address, chain[-1], num_kept)

    async def resume_elsewhere(self) -> Step:
        """Decode failover (frontend.resume): drop the lost stream, go on elsewhere; the next step."""
        return await resume_elsewhere(self)

    async def release(self, error: bool = False) -> None:
        """Abort whatever this request still holds on any worker; idempotent, never raises."""
        if self._released:
            return
        self._released = True
        # Metrics first: once a worker sees the abort, the request is already counted.
        self.observed.released(
            self.finish_reason or ("error" if error else "abort"),
            len(self.prompt_ids) if self.bills_prompt else 0,
            self.num_generated_tokens,
            processed=self.held.prefill_address is not None or self.num_generated_tokens > 0,
            finished=self.finish_reason is not None,
        )
        if self._group is None and not self.held.holds_anything:
            return  # nothing to abort (a finished request): no shielded scope to set up
        with anyio.CancelScope(shield=True):
            await self.held.release()
            if self._group is not None:  # the last sample out releases the group's prefill
                await self._group.release(self, error)

    # Pieces -----------------------------------------------------------------------------------

    def _open_decode(self, response: prefill_pb2.PrefillResponse) -> None:
        """Hand the prefilled request to its reserved decode worker: the reservation becomes a stream."""
        request = decode_request(
            self.request_id, self.prompt_ids, sampling_params_to_proto(self.params), response
        )
        request.output_token_ids.extend(self.resumed_ids)
        address = self.held.decode_address
        assert address is not None
        self.held.hold_stream(address, self.p.clients.decode(address, request, self.remaining_s()))

    def remaining_s(self) -> float:
        """Seconds left before the request's deadline; a 503 once it passed."""
        remaining = self.deadline_s - time.monotonic()
        if remaining <= 0:
            raise GatewayError(503, f"request timed out after {self.p.settings.request_timeout_s:g} s")
        return remaining

    # What SharedPrefill (frontend/samples.py) reaches by these names ------------------------------

    @property
    def _stream(self) -> DecodeStream | None:
        return self.held.stream

    @_stream.setter
    def _stream(self, stream: DecodeStream | None) -> None:
        self.held.stream = stream

    @property
    def _decode_address(self) -> str | None:
        return self.held.decode_address

    @property
    def _holds_reservation(self) -> bool:
        return self.held.holds_reservation

    @_holds_reservation.setter
    def _holds_reservation(self, holds: bool) -> None:
        self.held.holds_reservation = holds

    @property
    def _failover(self) -> DecodeFailover:
        return self.failover

    def _remaining_s(self) -> float:
        return self.remaining_s()

    async def _release_decode(self) -> None:
        await self.held.release_decode()
