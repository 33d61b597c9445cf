"""A request's `n` samples (`best_of` drawn) of one prompt: one prefill, one decode worker, n choices.

Each sample is a `Generation` of its own (a choice: its own detokenizer, stop strings, finish,
failover), with the parameters `SamplingParams.for_sample(i)` gives it (seed + i: each sample
equals a separate request with that seed). What they share runs once, in the group's leader
(`SharedPrefill`, a `Generation` for the whole request, routed like any): one Reserve holding
room for every sample on one decode worker, one Prefill that computes the prompt once, draws
every sample's first token from its last logits and writes its state once, and one Decode that
forks the state into every sample (their prompt KV blocks shared on the worker) and streams
them all, each delta naming its sample (`frontend.sample_stream`). Colocated workers, local
prefills and `prefill.fallback: decode_local` take the same request and fork in their engine.

Why one decode worker rather than a reservation per sample reading one stored key: the prompt's
state then moves once and is read once, the samples share its KV blocks on the worker instead of
holding a copy each (a prompt's latent KV is 8 KiB per token at the 48B shape; each sample still
needs its own KDA state, 41.4 MiB), the store needs no reader counts, and the admission, the
routing and the worker's accounting see one request of n slots. The cost: the samples of a
request cannot spread over decode workers (n is bounded by one worker's max_num_seqs, and by
MAX_SAMPLES), and a lost worker loses all of them at once.

Failover stays per sample: when the shared stream breaks, every sample still running resumes on
its own, as a re-prefill of prompt + its tokens under its own id and seed, so each continues
exactly (stored-state resume is for single-sample requests: the worker keeps no forked state).
"""

from __future__ import annotations

import asyncio

import anyio

from frontend.errors import GatewayError
from frontend.failover import WorkerLost, read_delta
from frontend.generate import Generation
from frontend.sample_stream import SharedStream
from frontend.steps import Step
from splitserve.sampling_params import sample_request_id
from splitserve.v1 import common_pb2, prefill_pb2
from splitserve.wire import decode_request, sampling_params_to_proto


class SampleGroup:
    """Owns the shared part of one prompt's samples: the leader's start (run once, awaited by
    every sample), each sample's first step, the shared decode stream, and the leader's release
    once the last sample is released."""

    def __init__(self, leader: SharedPrefill) -> None:
        self.params = params = leader.params
        self.leader = leader
        leader.group = self
        self.samples = [
            Generation(
                leader.p,
                sample_request_id(leader.request_id, i),
                leader.prompt_ids,
                params.for_sample(i),
                leader.arrival_s,
                prefix_hashes=leader.prefix_hashes,
                sample_index=i,
                group=self,
            )
            for i in range(params.num_samples)
        ]
        self.first_steps: dict[int, Step] = {}  # from the prefill's answer (else from the stream)
        self.shared: SharedStream | None = None
        self._started: set[int] = set()
        self._released: set[int] = set()
        self._task: asyncio.Future[Step] | None = None

    def began(self, sample: Generation) -> bool:
        """Whether `sample` already had its first step (a later start is its own: a failover)."""
        return sample.sample_index in self._started

    async def first_step(self, sample: Generation) -> Step:
        """`sample`'s first step, the group started once for all samples (its error raised to each)."""
        self._started.add(sample.sample_index)
        if self._task is None:
            self._task = asyncio.ensure_future(self.leader.start())
        await asyncio.shield(self._task)  # one sample cancelled does not cancel the others' start
        step = self.first_steps.get(sample.sample_index)
        if step is None:  # a worker that computed the prompt itself streams the first tokens too
            return await sample.next()
        return step

    def attach(self, shared: SharedStream, address: str) -> None:
        """The samples still running read their part of `shared`, on decode worker `address`."""
        self.shared = shared
        for index, view in shared.views.items():
            sample = self.samples[index]
            sample.attach_stream(view, address)

    async def release(self, sample: Generation, error: bool) -> None:
        """`sample` holds nothing any more; after the last one, the leader lets go of the rest."""
        self._released.add(sample.sample_index)
        if len(self._released) < len(self.samples):
            return
        with anyio.CancelScope(shield=True):
            if self._task is not None and not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            if self.shared is not None:
                await self.shared.close()
            await self.leader.release(error)


class SharedPrefill(Generation):
    """The start every sample of a group shares: a `Generation` of the whole request (its id,
    its n or best_of), routed, reserved, retried and prefilled like any; it shows no steps of its
    own, and is not counted in the metrics (its samples are): make it with `counted=False`."""

    group: SampleGroup  # set by the group that made it

    async def _begin(self, response: prefill_pb2.PrefillResponse) -> Step:
        """Every sample's first step from the prefill's answer, then one Decode of the samples
        still running (those a stop string ended here are marked, so the worker does not run them)."""
        group, starts = self.group, list(response.samples)
        if len(starts) != len(group.samples):
            raise GatewayError(
                503,
                f"the prefill answered {len(starts)} first tokens for {len(group.samples)} samples",
                code="worker_error",
            )
        self._note_first_token()
        for sample, start in zip(group.samples, starts):
            step = sample.take_first(start)
            group.first_steps[sample.sample_index] = step
            if step.finish_reason is not None and not start.finish_reason:
                start.finish_reason = common_pb2.FINISH_REASON_STOP  # a stop string: not decoded
        live = [i for i, start in enumerate(starts) if not start.finish_reason]
        if not live or response.finish_reason:
            await self._release_decode()
            return Step([], "")
        request = decode_request(
            self.request_id, self.prompt_ids, sampling_params_to_proto(self.params), response
        )
        request.samples.extend(starts)
        address = self._decode_address
        assert address is not None
        stream = self.p.clients.decode(address, request, self._remaining_s())
        self._holds_reservation = False
        group.attach(SharedStream(stream, live), address)
        return Step([], "")

    async def _first_streamed(self) -> Step:
        """A worker computing the prompt itself (a local prefill, decode_local) streams every
        sample's first token: the first delta is read here (a refusal shows on it), the rest
        by each sample from its part of the stream."""
        assert self._stream is not None and self._decode_address is not None
        try:
            delta = await read_delta(self._stream)
        except WorkerLost as lost:  # nothing reached a sample: the group starts again elsewhere
            return await self._failover.recover(self, lost, self.deadline_s)
        self.num_cached_tokens = delta.num_cached_tokens
        stream, self._stream = self._stream, None
        self.group.attach(
            SharedStream(stream, list(range(self.params.num_samples)), delta), self._decode_address
        )
        return Step([], "")
