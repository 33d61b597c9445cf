"""The engine's steps: schedule, queue on the device, read the tokens, stop; with async scheduling the
next step is scheduled and queued before the last one's tokens are read.

A step is *launched* (scheduled, its inputs built and its kernels queued: `ModelRunner.execute`
returns at once, its sampled ids still on the device) and later *finished* (its ids read on the host,
once, after their asynchronous copy; tokens appended, samples forked, stops checked, updates made).
Synchronously (`overlap` off) each step is finished right after its launch. With `overlap` (vLLM's
async scheduling, SGLang's overlap scheduler) a call launches step N+1 first and then finishes step
N, so the host's scheduling and input building for N+1 and its token handling for N run while the
device computes N+1, and the device never waits for the host between steps:

* Step N+1 is scheduled with step N's tokens pending (`Request.num_pending_tokens`): a request
  decoding in both takes its N+1 input id from step N's sampled tensor on the device
  (`PendingInputs`); one whose pending token ends it whatever its id (max_tokens, the context
  limit, prefill-only) is not scheduled again.
* Step N is finished after N+1 is queued. A request that stopped at N (EOS, a stop token; a stop
  string the caller finds in its update) had a row in N+1: that row's token is dropped when N+1 is
  finished, and its KV row and state step are harmless (past the request's end; its blocks and slot
  are freed or retained after N+1 in stream order, so retaining its end keeps the state the N+1
  row made, named by its tokens).
* What must follow step N on the device and precede N+1 runs between the two: the prefix cache's
  snapshots of N (`Scheduler.after_step`: N's input tokens are known by then) and the ReplaySSM
  publishes' copies (`ReplayPublisher.collect`, handed on when N is finished).
* A step whose tokens the next one needs on the host (a prompt whose other samples fork from it,
  a row with penalties, which read its output ids) is finished at once, overlap or not; so is a
  step after which nothing is left to schedule (its tokens come back in the same call).

Either way the tokens are the same: a request's tokens depend on its own rows only, and seeded draws
on the index of the token drawn, which counts the pending ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.engine.model_runner import StepResult
from splitserve.engine.replay_publish import PendingPublish
from splitserve.engine.request import Request
from splitserve.engine.sampler import has_penalty
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.stopping import check_stop

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine

HANDOFF = "handoff"  # finish reason of a prefill-only request whose decode continues elsewhere


@dataclass
class RequestUpdate:
    """What one step did to one request: tokens appended (with logprobs) and whether it ended.

    A snapshot taken when the step ran: other threads read it later, when the live `request`
    may have moved on (more tokens, finished), so they must use these fields, not the request's.
    `queue_s` is set on the first update after the request's arrival or admission only: the
    seconds it waited before its first schedule.
    """

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    queue_s: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (local or imported)


@dataclass
class LaunchedStep:
    """A step queued on the device and not finished yet."""

    output: SchedulerOutput
    result: StepResult
    sampling: list[Request]  # scheduled requests whose chunk samples: one pending token each
    needs_tokens: bool  # the next step needs this one's ids on the host (forks, penalties)
    publishes: list[PendingPublish] = field(default_factory=list)


def needs_tokens(sampling: list[Request]) -> bool:
    """Whether a step sampling for `sampling` must be finished before the next is scheduled: a prompt
    whose other samples fork from it (the fork copies its state and takes their tokens) or a row with
    penalties (its next draw reads its output ids)."""
    return any(
        any(not r.finished for r in request.samples_to_fork) or has_penalty(request.params)
        for request in sampling
    )


class StepPipeline:
    """Owns the step in flight (at most one, with `overlap`) and turns steps into `RequestUpdate`s.

    Promises: every launched step is finished exactly once, in launch order; `step()` returns the
    updates of the steps it finished; nothing is in flight when `in_flight` is False.
    """

    def __init__(self, engine: LLMEngine, overlap: bool) -> None:
        self.engine = engine
        self.overlap = overlap
        self._in_flight: LaunchedStep | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self) -> list[RequestUpdate]:
        """Launch the next step, finish the one before it (if any), and, without overlap or when the
        next step needs its tokens, finish the new one too."""
        previous, self._in_flight = self._in_flight, None
        launched = self._launch(previous)
        updates = self._finish(previous) if previous is not None else []
        if launched is None:
            return updates
        self.engine.scheduler.after_step(launched.output)  # its inputs' tokens are all known now
        if self.engine.replay is not None:
            launched.publishes = self.engine.replay.collect([s.request for s in launched.output.scheduled])
            self.engine.relay_replays(launched.publishes)  # tensor parallel: every rank's KDA heads of them
        if self.overlap and not launched.needs_tokens and self.engine.scheduler.has_next_step:
            self._in_flight = launched
        else:
            updates += self._finish(launched)
        return updates

    def _launch(self, previous: LaunchedStep | None) -> LaunchedStep | None:
        scheduler = self.engine.scheduler
        output = scheduler.schedule()
        if not output.scheduled:
            return None
        now = time.monotonic()
        for s in output.scheduled:
            if s.request.first_scheduled_s is None:
                s.request.first_scheduled_s = now
        result = self.engine.runner.execute(
            output.scheduled, previous.result if previous is not None else None
        )
        self.engine.relay_exports()  # tensor parallel: the ranks' KDA shares of exports in this step
        sampling = scheduler.advance(output)
        return LaunchedStep(output, result, sampling, needs_tokens(sampling))

    def _finish(self, step: LaunchedStep) -> list[RequestUpdate]:
        """Read the step's ids and apply them: tokens, forked samples, stops, updates, publishes."""
        engine, scheduler = self.engine, self.engine.scheduler
        token_ids = step.result.token_ids  # waits for the step's copy to the host, if still running
        taken = []
        for request in step.sampling:
            if request.finished:  # aborted, or stopped at the step before: this row's token is dropped
                request.num_pending_tokens -= 1
                continue
            scheduler.take_token(request, token_ids[request.request_id])
            taken.append(request)
        drawn = self._fork_samples(taken, token_ids)  # before any stop frees a prompt
        updates = []
        eos, max_model_len = engine.model_config.eos_token_ids, engine.max_model_len
        for request in taken + drawn:
            token = token_ids[request.request_id]
            logprobs = step.result.logprobs.get(request.request_id)
            if logprobs is not None:
                request.output_logprobs.append(logprobs)
            stop = check_stop(request, eos, max_model_len)
            if stop is None and request.prefill_only:
                stop = (HANDOFF, None)
            if stop is not None:
                scheduler.finish(request, *stop)
                engine.requests.pop(request.request_id, None)
            updates.append(
                RequestUpdate(
                    request,
                    [token],
                    [logprobs] if logprobs is not None else [],
                    finished=request.finished,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    queue_s=request.take_queue_s(),
                    num_cached_tokens=request.num_cached_tokens,
                )
            )
        if engine.replay is not None:  # after the stops: a finished request publishes nothing more
            engine.replay.deliver([s.request for s in step.output.scheduled], step.publishes)
        return updates

    def _fork_samples(self, sampled: list[Request], token_ids: dict[str, int]) -> list[Request]:
        """The samples that drew their first token this step from the prompt of one that sampled:
        each takes its token and, unless that ended it (or it is prefill-only), a fork of the
        prompt's state, or a place in the queue to compute it when there is no room."""
        engine = self.engine
        drawn = []
        for parent in sampled:
            waiting = parent.samples_to_fork
            if not waiting:
                continue
            parent.samples_to_fork = []
            for sample in waiting:
                if sample.finished:  # aborted while it waited
                    continue
                sample.output_token_ids.append(token_ids[sample.request_id])
                sample.first_scheduled_s = parent.first_scheduled_s
                drawn.append(sample)
                if sample.prefill_only or check_stop(
                    sample, engine.model_config.eos_token_ids, engine.max_model_len
                ):
                    continue  # ended by the caller's loop
                if not engine.forker.fork(parent, sample):
                    sample.num_given_output_tokens = 1  # computed with the prompt, sampling goes on after it
                    engine.scheduler.add(sample)
        return drawn
