"""One request inside the engine: its tokens, progress, and the cache resources it holds."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Owns nothing but ids: `block_table` (KV blocks, in order) and `state_slot` (KDA slot).

    `num_computed_tokens` counts tokens whose KV and state are in the caches; the request needs
    a sample when every known token is computed. After a recompute preemption the generated
    tokens are replayed as prompt: `all_token_ids` is what gets (re)computed.

    `arrival_s` (when it was added, or admitted after a state transfer) and `first_scheduled_s`
    are `time.monotonic()` readings; their difference is the request's queue time.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: int
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # async scheduling: output tokens sampled on the device whose ids the host has not read yet (at
    # most two: the last step's, and the one queued after it). They count in `num_tokens`, so the
    # next decode is scheduled before they are known; `output_token_ids` gets each when it is read.
    num_pending_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # prefill-only requests end after their first token; `export` receives each layer's state
    # (a LayerState) as the final prompt chunk finishes that layer
    prefill_only: bool = False
    export: Callable[[Any], None] | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None
    # output tokens generated elsewhere before this request came here (failover, re-prefill): they
    # are computed like the prompt, and sampling continues at output index len(output_token_ids)
    num_given_output_tokens: int = 0
    # prefix caching: the prompt's hash chain as given (None: the engine names it), an imported
    # prefix state to start from, and the prompt tokens the cache served (0 without a hit)
    prefix_hashes: list[bytes] | None = None
    imported_prefix: Any = None  # engine.prefix_cache.ImportedPrefix (request.py stays import-free)
    num_cached_tokens: int = 0
    # input tokens (prompt and given outputs) the cache served at its latest admission, local and
    # imported: unlike num_cached_tokens, not capped at the prompt (a failover's hit may reach into
    # the given outputs), and set again after a preemption; its first chunk exports them too
    num_reused_tokens: int = 0
    cache_state: Any = None  # engine.prefix_cache's per-request bookkeeping, None without caching
    # parallel sampling (engine/parallel_sampling.py): which sample of its request this is; on the
    # sample that computes the prompt, the others, which draw their first token from the same
    # last-position logits and then fork its state; on a reservation, the slots and blocks held
    # for the samples it forks into on admission
    sample_index: int = 0
    samples_to_fork: list[Request] = field(default_factory=list)
    fork_slots: list[int] = field(default_factory=list)
    fork_blocks: list[int] = field(default_factory=list)
    _queue_reported: bool = field(default=False, repr=False)

    @property
    def queue_s(self) -> float | None:
        """Seconds from arrival to the first schedule; None until it is scheduled."""
        if self.first_scheduled_s is None:
            return None
        return self.first_scheduled_s - self.arrival_s

    def take_queue_s(self) -> float | None:
        """`queue_s` the first time it is asked for once scheduled, None afterwards (one report each)."""
        if self._queue_reported or self.first_scheduled_s is None:
            return None
        self._queue_reported = True
        return self.queue_s

    @property
    def num_tokens(self) -> int:
        """Tokens so far, the pending ones included (`num_known_tokens` without them)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens so far, the pending ones included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_input_tokens(self) -> int:
        """Tokens known when it arrived (prompt and given output tokens): computed before any sample."""
        return len(self.prompt_token_ids) + self.num_given_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens `start..stop` of prompt + outputs, as list slices (no per-token work); known ones
        only (`stop <= num_known_tokens`)."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def running_slot(self) -> int:
        """`state_slot` of a request a step runs (every scheduled request holds one)."""
        assert self.state_slot is not None, f"{self.request_id} runs without a state slot"
        return self.state_slot

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
