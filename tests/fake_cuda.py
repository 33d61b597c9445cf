"""Stand-ins for the CUDA calls of the state path, so the CPU runs the CUDA branch's own code.

`install_fake_cuda(monkeypatch)` swaps `torch.cuda.Stream`, `current_stream`, `stream` (the
context), `Event` and `synchronize`, and `splitserve.engine.host_staging.pinned_empty_like` (a
plain host tensor, recorded); tensors stay on the CPU, so every copy the path makes really runs.
It records the pinned buffers made, which stream each event was recorded on and which threads
waited for it, and each side stream's syncs; a sync of the compute stream (the caller's current
stream) or of the whole device fails the test where it happens.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from splitserve.engine import host_staging


class FakeStream:
    def __init__(self, name: str, cuda: FakeCuda) -> None:
        self.name, self._cuda = name, cuda
        self.waited_for: list[FakeStream] = []  # streams whose work this one was told to wait for
        self.num_syncs = 0

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other)

    def synchronize(self) -> None:
        if self is self._cuda.compute:
            raise AssertionError("the compute stream was synchronized")
        self.num_syncs += 1


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self._cuda = cuda
        self.stream: FakeStream | None = None
        self.waiting_threads: list[int] = []  # thread idents that waited for it

    def record(self, stream: FakeStream) -> None:
        assert self._cuda.current_stream() is stream, "an event recorded outside its stream's context"
        self.stream = stream

    def synchronize(self) -> None:
        assert self.stream is not None, "waited for an event never recorded"
        self.waiting_threads.append(threading.get_ident())


class FakeCuda:
    """What the state path asked of "CUDA"."""

    def __init__(self) -> None:
        self.compute = FakeStream("compute", self)
        self.side_streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.pinned: list[torch.Tensor] = []  # every pinned buffer made, in order
        self._current = threading.local()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views one of the pinned buffers made (by its storage)."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(ptr == p.untyped_storage().data_ptr() for p in self.pinned)

    def Stream(self, device: object = None) -> FakeStream:  # noqa: N802 - torch.cuda's name
        stream = FakeStream(f"side-{len(self.side_streams)}", self)
        self.side_streams.append(stream)
        return stream

    def current_stream(self, device: object = None) -> FakeStream:
        return getattr(self._current, "stream", None) or self.compute

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def Event(self) -> FakeEvent:  # noqa: N802 - torch.cuda's name
        event = FakeEvent(self)
        self.events.append(event)
        return event

    def pinned_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.pinned.append(buffer)
        return buffer


def _device_synchronize(device: object = None) -> None:
    raise AssertionError("torch.cuda.synchronize() was called: the whole device was synced")


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", cuda.Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", _device_synchronize)
    monkeypatch.setattr(host_staging, "pinned_empty_like", cuda.pinned_empty_like)
    monkeypatch.setattr(host_staging, "_streams", {})  # no side stream outlives the test
    return cuda
