"""Continuous batching: decides which requests run this step and how many tokens each computes.

One token budget (`max_num_batched_tokens`) covers decodes and prefill chunks alike, running
requests first (oldest first), then waiting ones in arrival order. A request that cannot get
the KV blocks it needs preempts the newest running request: by recompute (its caches are freed
and its tokens replayed later) or, with a `Swapper` (engine/swap_space.py) and a request that is
decoding, by swap (its state is copied out before its blocks and slot are freed, and scattered
back into new ones when it is admitted again; a swap the space refuses or loses falls back to
recompute). A prefill chunk is as long as the budget left allows. The scheduler decides; it
touches no tensor itself (a swap's copies are the swapper's).

With a prefix cache (`engine.prefix_cache`), a request admitted from the queue starts at its hit
(the cache copies what it needs into the request's own blocks and slot), its chunks end exactly at
the boundaries where a snapshot is to be taken, and blocks are released by reference: blocks
shared with other requests or kept in the cache are never freed or written by a sharer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.cache_pool import BlockAllocator, SlotAllocator
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.stopping import ends_with_pending

if TYPE_CHECKING:
    from splitserve.engine.prefix_cache.cache import PrefixCache
    from splitserve.engine.swap_space import Swapper


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the last known token, so a new token gets sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]


class Scheduler:
    """Owns the waiting queue, the running list and every request's blocks and slot."""

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockAllocator,
        slots: SlotAllocator,
        prefix_cache: PrefixCache | None = None,
        swapper: Swapper | None = None,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.prefix_cache = prefix_cache
        self.swapper = swapper
        self.swapped: set[str] = set()  # waiting requests whose state is in the swap space
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}  # room held for requests whose state is arriving
        self.num_preemptions = 0  # since start, for metrics and tests

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_next_step(self) -> bool:
        """Whether a next step would have anything to compute, however the pending tokens turn out."""
        return bool(self.waiting) or any(
            not ends_with_pending(r, self.config.max_model_len) for r in self.running
        )

    @property
    def num_seqs(self) -> int:
        """Requests running or reserved, with the samples a reservation holds room for."""
        return len(self.running) + sum(1 + len(r.fork_slots) for r in self.reserved.values())

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if ends_with_pending(request, self.config.max_model_len):
                continue  # its last step's token ends it, whichever it is: nothing more to compute
            num_new = self._chunk_len(request, budget)
            while not self.reserve_blocks(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and not preempted and self.num_seqs < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.slots.num_free_slots == 0 or request.num_pending_tokens:
                break  # (a request preempted while its last token was pending: recomputed once it is known)
            request.state_slot = self.slots.allocate()
            swapped = request.request_id in self.swapped  # it resumes at its computed tokens
            if self.prefix_cache is not None and not swapped:
                self.prefix_cache.admit(request)  # starts it at its hit, plans its snapshots
            if not swapped:  # what the cache served (0 without a hit): rows a handoff ships too
                request.num_reused_tokens = request.num_computed_tokens
            num_new = self._chunk_len(request, budget)
            if not self.reserve_blocks(request, num_new):
                self.release(request)
                if not swapped:
                    request.num_computed_tokens = 0
                break
            if swapped and not self._swap_in(request):
                continue  # its state is lost: it is admitted again as a fresh request, now
            if self.prefix_cache is not None:
                self.prefix_cache.confirm(request)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Hold a state slot and KV blocks for `num_tokens` tokens whose state comes from elsewhere.

        A reserved request is in neither `waiting` nor `running`: no step schedules, reads or
        preempts it, so its blocks and slot are private to whoever fills them (another thread,
        see engine/transfer_sink.py) until `admit_reserved` or `finish` hands them on.
        """
        if self.num_seqs >= self.config.max_num_seqs or self.slots.num_free_slots == 0:
            return False
        if not self.reserve_blocks(request, num_tokens):
            return False
        request.state_slot = self.slots.allocate()
        self.reserved[request.request_id] = request
        return True

    def admit_reserved(self, request: Request) -> None:
        """The reserved request's state is in place: it joins the running batch as is."""
        del self.reserved[request.request_id]
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished and free its blocks and slot (works for waiting and running requests).
        With a prefix cache, what a running request computed is retained first (unless aborted)."""
        if request.request_id in self.swapped:  # it ends while waiting swapped out
            self.swapped.discard(request.request_id)
            assert self.swapper is not None
            self.swapper.drop(request)
        if request.status is RequestStatus.RUNNING:
            if self.prefix_cache is not None and reason != "abort":
                self.prefix_cache.retain_end(request)
            self.running.remove(request)
        elif self.reserved.get(request.request_id) is request:
            del self.reserved[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        self.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason

    def _chunk_len(self, request: Request, budget: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.prefix_cache is not None:
            num_new = self.prefix_cache.clip_chunk(request, num_new)  # end at a snapshot boundary
        return num_new

    def reserve_blocks(self, request: Request, num_new: int) -> bool:
        bs = self.config.block_size
        needed = -(-(request.num_computed_tokens + num_new) // bs) - len(request.block_table)
        if needed <= 0:
            return True
        got = self.blocks.allocate(needed)
        if got is None:
            return False
        request.block_table.extend(got)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        swapped = (
            self.swapper is not None and self.swapper.swappable(request) and self.swapper.swap_out(request)
        )
        self.release(request)
        request.status = RequestStatus.WAITING
        if swapped:
            self.swapped.add(request.request_id)  # keeps its progress and its snapshot plan
        else:
            self._restart(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _restart(self, request: Request) -> None:
        """Forget what the request computed: it is recomputed from token 0 when admitted."""
        request.num_computed_tokens = 0
        if request.cache_state is not None:  # planned and indexed again from its hit when readmitted
            request.cache_state.boundaries = []
            request.cache_state.num_published_units = 0

    def _swap_in(self, request: Request) -> bool:
        """Scatter a swapped request's state into the blocks and slot just held for it; on a
        loss, give them back and make it a fresh waiting request (still first in the queue)."""
        assert self.swapper is not None
        self.swapped.discard(request.request_id)
        if self.swapper.swap_in(request):
            return True
        self.release(request)
        self._restart(request)
        return False

    def release(self, request: Request) -> None:
        """Give back its slot and its references to its blocks (a caching allocator keeps the
        blocks the cache indexes; the plain one frees them all)."""
        self.blocks.free(request.block_table)
        request.block_table = []
        if request.state_slot is not None:
            self.slots.free(request.state_slot)
            request.state_slot = None
        self.release_fork_room(request)

    def release_fork_room(self, request: Request) -> None:
        """Give back the room a reservation held for samples it did not fork into."""
        self.blocks.free(request.fork_blocks)
        for slot in request.fork_slots:
            self.slots.free(slot)
        request.fork_blocks, request.fork_slots = [], []

    def advance(self, output: SchedulerOutput) -> list[Request]:
        """A step is queued: every scheduled request moves past its chunk, and each whose chunk
        samples holds one pending token until `take_token`. Returns those (in order)."""
        sampling = [s.request for s in output.scheduled if s.samples]
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        for request in sampling:
            request.num_pending_tokens += 1
        return sampling

    def after_step(self, output: SchedulerOutput) -> None:
        """Once the step's inputs are all known on the host (the last step's tokens taken): the
        prefix cache indexes the units it completed and takes the snapshots it reached."""
        if self.prefix_cache is not None:
            self.prefix_cache.after_step([s.request for s in output.scheduled])

    @staticmethod
    def take_token(request: Request, token_id: int) -> None:
        """The oldest pending token of `request` is read: it becomes an output token."""
        request.num_pending_tokens -= 1
        request.output_token_ids.append(token_id)

    def postprocess(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """`advance`, `after_step` and `take_token` at once (a step run synchronously)."""
        for request in self.advance(output):
            token = sampled.get(request.request_id)
            if token is None:
                request.num_pending_tokens -= 1  # nothing sampled for it after all
            else:
                self.take_token(request, token)
        self.after_step(output)
