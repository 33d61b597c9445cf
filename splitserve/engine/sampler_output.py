"""What one sampler call leaves on the device, and its one asynchronous trip to the host.

The sampler never reads a value back inside a step: the sampled ids (and, for rows that asked, the
logprob tensors) stay on the device, where the next step's inputs take them, and one non-blocking
copy per tensor into pinned host memory is queued behind them with an event. The engine reads the
host side later (`token_ids`, `logprobs`): the next iteration, after it has queued the next step,
so the wait on the event is for work that is done or nearly so. On a CPU the tensors are on the
host already and nothing is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class HostReadback:
    """Owns pinned host copies of some device tensors and the event recorded after them.

    Promises: `host()` returns the values the tensors held when the copies were queued (it waits
    for the event, never for the stream); `done()` says, without waiting, whether it would wait.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event: Any = None
        device = tensors[0].device if tensors else torch.device("cpu")
        if device.type == "cpu":  # on the host already: nothing to copy
            self._host = tensors
            return
        cuda = device.type == "cuda"
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
        for dst, src in zip(self._host, tensors):
            dst.copy_(src, non_blocking=True)
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def host(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


@dataclass
class LogprobTensors:
    """The logprobs of the rows that asked (`rows`, in order), on the device: each row's sampled
    token's logprob [A], and the top `top_n` of the raw distribution, values and ids [A, top_n]."""

    rows: list[int]
    top_n: list[int]  # per asked row: how many of the top it wants
    sampled: torch.Tensor
    top_vals: torch.Tensor
    top_ids: torch.Tensor


class SamplerOutput:
    """One token per row: `sampled` on the device at once, `token_ids` and `logprobs` (None for a
    row that did not ask; the list None if none did) on the host when first read.

    Built from host lists (tests, stand-ins) it holds them as they are.
    """

    def __init__(
        self,
        sampled: torch.Tensor | list[int],
        logprobs: LogprobTensors | list[dict[int, float] | None] | None = None,
    ) -> None:
        self._token_ids: list[int] | None = None
        self._logprobs: list[dict[int, float] | None] | None = None
        self._lp_tensors: LogprobTensors | None = None
        self._readback: HostReadback | None = None
        if isinstance(sampled, list):
            self.sampled = torch.tensor(sampled, dtype=torch.long)
            self._token_ids = sampled
            self._logprobs = logprobs if isinstance(logprobs, list) else None
            return
        self.sampled = sampled
        tensors = [sampled]
        if isinstance(logprobs, LogprobTensors):
            self._lp_tensors = logprobs
            tensors += [logprobs.sampled, logprobs.top_vals, logprobs.top_ids]
        self._readback = HostReadback(tensors)

    @property
    def num_rows(self) -> int:
        return int(self.sampled.shape[0])

    def ready(self) -> bool:
        """Whether reading the host side now would not wait for the device."""
        return self._readback is None or self._readback.done()

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            self._read()
        assert self._token_ids is not None
        return self._token_ids

    @property
    def logprobs(self) -> list[dict[int, float] | None] | None:
        if self._token_ids is None:
            self._read()
        return self._logprobs

    def _read(self) -> None:
        assert self._readback is not None
        host = self._readback.host()
        tokens = host[0].tolist()
        self._token_ids = tokens
        lp = self._lp_tensors
        if lp is None:
            return
        sampled, top_vals, top_ids = (t.tolist() for t in host[1:])
        out: list[dict[int, float] | None] = [None] * len(tokens)
        for j, i in enumerate(lp.rows):
            n = lp.top_n[j]
            entry = dict(zip(top_ids[j][:n], top_vals[j][:n]))
            entry.setdefault(tokens[i], sampled[j])
            out[i] = entry
        self._logprobs = out
