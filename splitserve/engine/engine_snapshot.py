"""What a worker's load reports read of its engine, copied on the engine thread after each step.

`EngineLoop` takes one `EngineSnapshot` when it is built and again at the end of every pass of
its thread (commands, then a step if any request is unfinished), so the state it holds while
the thread waits for work is the engine's current state. Readers on other threads (the
controller's `stats()`, `Decode.Stats`, `Prefill.CacheReport`) use the latest one instead of
queueing behind a step that may take seconds (a long prompt's prefill chunk).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.prefix_cache.stats import PrefixCacheStats
from splitserve.engine.swap_space import SwapStats

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load and counters at one moment; a copy, never changed after it is taken.

    `taken_s` is the loop clock's reading (time.monotonic by default) when it was taken.
    """

    taken_s: float
    num_waiting: int
    num_running: int
    num_reserved: int  # room held for requests whose state is arriving (one per sample of each)
    max_num_seqs: int
    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_free_state_slots: int
    num_total_state_slots: int
    num_preemptions: int  # since start
    swap: SwapStats  # swap preemption's counters since start (zeros when preempting by recompute)
    prefix_cache: PrefixCacheStats  # the prefix cache's counters since start (zeros without caching)

    @property
    def num_held_requests(self) -> int:
        """Requests the engine holds in any form: waiting, running or reserved."""
        return self.num_waiting + self.num_running + self.num_reserved

    @classmethod
    def of(cls, engine: LLMEngine, taken_s: float) -> EngineSnapshot:
        """Copy what the readers need; only on the thread that drives `engine`."""
        sched = engine.scheduler
        return cls(
            taken_s=taken_s,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_reserved=sched.num_seqs - len(sched.running),
            max_num_seqs=engine.config.max_num_seqs,
            num_free_kv_blocks=sched.blocks.num_free_blocks,
            num_total_kv_blocks=engine.plan.num_blocks,
            num_free_state_slots=sched.slots.num_free_slots,
            num_total_state_slots=engine.plan.num_slots,
            num_preemptions=sched.num_preemptions,
            swap=dataclasses.replace(engine.swap_stats()),  # the swapper keeps counting in its own
            prefix_cache=engine.prefix_cache_stats(),  # already a copy
        )
