"""Where a reserved request's arriving state lands: written from the reader's thread, not the engine's.

Why writing from another thread is safe while the engine keeps stepping:

* Ownership. `Scheduler.reserve` gives the request its KV blocks and state slot and parks it in
  `Scheduler.reserved`, which `schedule` never reads: no step reads or writes a reserved request's
  rows or slot, and preemption only takes running requests. The room changes hands only through
  `LLMEngine.abort_request` (freed) or `admit_transferred` (the request runs); both close the sink
  first, under its lock, so a piece being written finishes before the room is freed or read, and
  none is written after.
* Disjoint memory. A step writes other requests' rows and slots of the same cache tensors. On
  CPU an `index_copy_` into disjoint rows from another thread is a plain memcpy into memory
  nobody else touches (torch releases the GIL; tensor metadata is not changed). On CUDA the
  pieces are copied on a side stream of their own, which first waits for the reservation's
  stream position (the slot was zeroed there), and each write is synchronized before it counts,
  so `complete` means the bytes are in device memory before the request can be admitted.

On CUDA nothing crosses to the device from pageable memory (`host_staging`): a piece (a view of
the store's arena, or gRPC bytes) is copied once into a pinned buffer and goes to the device as
one DMA on the side stream; the reservation's row indices are pinned once, at the start.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import torch

from splitserve.engine.host_staging import stage_pinned
from splitserve.engine.model.kimi_linear import LayerCaches
from splitserve.engine.state_transfer import LayerState, cache_for, write_piece
from splitserve.state import CorruptStateError, StateKind


class TransferSink:
    """Owns the writes into one reserved request's rows and slot and what has landed so far.

    Thread-safe: `write` from any thread (one writer at a time is taken in, under the lock);
    `close` from the engine thread. Counts MLA tokens per layer (each token once) and KDA states,
    so `complete` is true once the whole prompt's state is in, however it was cut.
    """

    def __init__(
        self,
        caches: LayerCaches,
        rows: torch.Tensor,
        slot: int,
        num_prompt_tokens: int,
        device: torch.device,
    ) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.num_bytes = 0
        self._caches, self._rows, self._slot = caches, rows, slot
        self._lock = threading.Lock()
        self._closed = False
        self._covered = {lid: np.zeros(num_prompt_tokens, dtype=bool) for lid in caches.mla_kv}
        self._num_tokens = dict.fromkeys(caches.mla_kv, 0)
        self._kda: set[tuple[int, StateKind]] = set()
        self._num_kda = 2 * len(caches.kda_conv)
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # the slot's zeroing first
            self._rows = stage_pinned(rows)  # each piece's slice of it goes over as a DMA

    @property
    def complete(self) -> bool:
        with self._lock:
            return self._complete_locked()

    def missing(self) -> str:
        """What has not arrived yet, in words (for errors)."""
        with self._lock:
            short = {lid: self.num_prompt_tokens - n for lid, n in self._num_tokens.items() if n}
            silent = [lid for lid, n in self._num_tokens.items() if not n]
            return (
                f"{len(self._kda)} of {self._num_kda} KDA states; MLA layers with no rows: {silent}; "
                f"tokens still missing per MLA layer: {short}"
            )

    def write(self, state: LayerState) -> None:
        """Scatter one piece into the reserved room. Raises ValueError if it does not fit the
        reservation, CorruptStateError if it repeats what already landed, RuntimeError once closed."""
        if state.prompt_len != self.num_prompt_tokens:
            raise ValueError(
                f"state covers a prompt of {state.prompt_len} tokens; {self.num_prompt_tokens} were reserved"
            )
        if not 0 <= state.token_start < state.token_end <= self.num_prompt_tokens:
            raise ValueError(
                f"state covers tokens [{state.token_start}, {state.token_end}); the prompt has "
                f"{self.num_prompt_tokens}"
            )
        cache_for(self._caches, state)  # shape and dtype, before anything is marked
        with self._lock:
            if self._closed:
                raise RuntimeError("the reservation was admitted or freed; no more state is taken in")
            self._mark_locked(state)
            if self._stream is None:
                write_piece(self._caches, state, self._rows, self._slot)
            else:
                staged = dataclasses.replace(state, tensor=stage_pinned(state.tensor))
                with torch.cuda.stream(self._stream):
                    write_piece(self._caches, staged, self._rows, self._slot)
                self._stream.synchronize()
            self.num_bytes += state.num_bytes

    def close(self) -> bool:
        """No more writes (waits for one in progress); returns whether the state was complete."""
        with self._lock:
            self._closed = True
            return self._complete_locked()

    def _complete_locked(self) -> bool:
        return len(self._kda) == self._num_kda and all(
            n == self.num_prompt_tokens for n in self._num_tokens.values()
        )

    def _mark_locked(self, state: LayerState) -> None:
        if state.kind is StateKind.MLA_KV:
            covered = self._covered[state.layer_id][state.token_start : state.token_end]
            if covered.any():
                raise CorruptStateError(
                    f"{_what(state)} tokens [{state.token_start}, {state.token_end}) arrived twice"
                )
            covered[:] = True
            self._num_tokens[state.layer_id] += state.token_end - state.token_start
            return
        if (state.layer_id, state.kind) in self._kda:
            raise CorruptStateError(f"{_what(state)} arrived twice")
        self._kda.add((state.layer_id, state.kind))


def _what(state: LayerState) -> str:
    """The piece in words, for errors only (not formatted for every piece that lands)."""
    return f"layer {state.layer_id} {StateKind(state.kind).value}"
