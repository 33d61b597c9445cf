"""Parallel sampling (`n`, `best_of`): a prompt computed once, its samples forked from its state.

A request of k samples runs as k engine requests, ids `sample_request_id(id, i)`, sample i with
`params.for_sample(i)` (seed + i when seeded: each sample equals a separate request with that
seed). Sample 0 computes the prompt; the others wait on it (`Request.samples_to_fork`) outside
the scheduler. At the step that computes the prompt's last token, every sample draws its first
token from that one row of logits, each with its own parameters and seed (the runner repeats the
row); then each other sample forks sample 0's state (`SampleForker`) and decodes on its own.

A fork costs a state slot and at most one KV block: the KDA conv and recurrent state are copied
into the sample's own slot (ReplaySSM records folded first), the prompt's whole KV blocks are
shared by reference (the allocator counts the block tables holding each; a sample writes only
positions past the prompt, so it never writes a shared block), and a partial last block is
copied into a block of the sample's own before it writes its first token there. A sample that
finds no free slot (or block) then is queued instead to compute prompt + its first token itself
(like a decode failover's re-prefill: the same tokens, at the cost of that prefill). A decode
engine that takes a prompt's state from elsewhere reserves the samples' slots and blocks with it
(`reserve_room`) and forks on admission (`LLMEngine.admit_transferred_samples`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.cache_pool import copy_kv_rows, copy_state_slot
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import Scheduler
from splitserve.sampling_params import SamplingParams, sample_request_id


@dataclass(frozen=True)
class SampleStart:
    """A sample's first token, drawn where its prompt was computed (a prefill worker), and
    whether that token already ended it (then it is not decoded)."""

    token_id: int
    logprobs: dict[int, float] | None = None
    finished: bool = False


def make_samples(first: Request, new_request: Callable[[str, SamplingParams], Request]) -> list[Request]:
    """The engine requests of `first` (validated, named by its request's id): itself for one
    sample; else one per sample, `first` becoming sample 0 and holding the others
    (`samples_to_fork`), which `new_request(id, params)` makes."""
    params, request_id = first.params, first.request_id
    if params.num_samples == 1:
        return [first]
    others = [
        new_request(sample_request_id(request_id, i), params.for_sample(i))
        for i in range(1, params.num_samples)
    ]
    first.request_id, first.params = sample_request_id(request_id, 0), params.for_sample(0)
    samples = [first, *others]
    for i, sample in enumerate(samples):
        sample.sample_index = i
    first.samples_to_fork = others
    return samples


class SampleForker:
    """Forks a computed prompt's state into other samples' slots and blocks (see the module
    docstring); owns no memory itself: the scheduler's allocators lend it. Engine thread only."""

    def __init__(self, scheduler: Scheduler, caches: LayerCaches, block_size: int) -> None:
        self.scheduler = scheduler
        self.caches = caches
        self.block_size = block_size

    def reserve_room(self, request: Request, num_samples: int) -> bool:
        """Hold a slot and a block for each of `num_samples` samples (beside the reservation
        `request` holds); False (nothing held) when there is not that much room."""
        scheduler = self.scheduler
        if scheduler.num_seqs + num_samples > scheduler.config.max_num_seqs:
            return False
        if scheduler.slots.num_free_slots < num_samples:
            return False
        blocks = scheduler.blocks.allocate(num_samples)
        if blocks is None:
            return False
        request.fork_blocks = blocks
        request.fork_slots = [
            scheduler.slots.allocate() or 0 for _ in range(num_samples)
        ]  # checked free above
        return True

    def fork(self, parent: Request, sample: Request) -> bool:
        """`sample` (its first token appended) takes a copy of `parent`'s prompt state and joins
        the running batch; False when there is no room for it now (nothing held)."""
        scheduler = self.scheduler
        block: int | None = None
        if parent.fork_slots:  # room reserved with the prompt's state
            slot, block = parent.fork_slots.pop(), parent.fork_blocks.pop()
        else:
            free = scheduler.slots.allocate() if scheduler.num_seqs < scheduler.config.max_num_seqs else None
            if free is None:
                return False
            slot = free
        num_prompt = parent.num_computed_tokens
        num_full, num_partial = divmod(num_prompt, self.block_size)
        table = parent.block_table[: -(-num_prompt // self.block_size)]
        if num_partial and block is None:
            got = scheduler.blocks.allocate(1)
            if got is None:
                scheduler.slots.free(slot)
                return False
            block = got[0]
        scheduler.blocks.share(table[:num_full])
        sample.block_table = list(table[:num_full])
        if num_partial:
            assert block is not None
            copy_kv_rows(self.caches, table[num_full], block, num_partial, self.block_size)
            sample.block_table.append(block)
        elif block is not None:
            sample.block_table.append(block)  # reserved: where its first token's row goes
        assert parent.state_slot is not None
        copy_state_slot(self.caches, parent.state_slot, slot)
        sample.state_slot = slot
        sample.num_computed_tokens = num_prompt
        sample.num_cached_tokens = parent.num_cached_tokens
        sample.num_reused_tokens = parent.num_reused_tokens
        if parent.cache_state is not None:  # the prefix cache's names of the prompt, not hashed again
            state = parent.cache_state
            sample.cache_state = dataclasses.replace(state, chain=list(state.chain), boundaries=[])
        sample.status = RequestStatus.RUNNING
        scheduler.running.append(sample)
        return True
