"""State bytes between a CUDA device and host memory, always through pinned (page-locked) buffers.

A copy between a device and pageable host memory costs twice: the driver stages it through a
pinned buffer of its own (one more memcpy per byte), and a pageable host-to-device copy first
synchronizes its stream. So state that leaves a device or comes back to one goes through buffers
from torch's caching host allocator (pinned once, then reused):

* Out (`to_pinned`): one device-to-host copy of a device tensor into a pinned buffer, queued on
  the device's side stream (`copy_stream`), which first waits, on the device, for what the
  caller's current stream has queued so far (the engine thread queues and goes on: no sync of
  the compute stream). Whoever reads the buffer (the store client's sending thread, which copies
  it into the store's shared-memory arena) first calls `PinnedCopy.wait`: that copy alone.
* In (`stage_pinned`): a host tensor (a read-only view of the store's arena, or gRPC bytes)
  copied once into a pinned buffer, from which `.to(device, non_blocking=True)` is one DMA queued
  on the caller's stream; `to_device` does both for small host tensors (row indices).

Only `pinned_empty_like` and the `torch.cuda` stream and event calls are CUDA-specific: the CPU
tests swap those for fakes and run the rest of this path on CPU tensors.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_streams: dict[torch.device, Any] = {}  # device -> its side stream (`copy_stream`)
_streams_lock = threading.Lock()


def pinned_empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """A new contiguous host tensor of `tensor`'s shape and dtype in pinned memory (uninitialised)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)


def copy_stream(device: torch.device) -> Any:
    """The side stream `device`'s state copies run on: one per device, made on first use."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device)
        return stream


class PinnedCopy:
    """One device tensor's copy into a pinned host buffer (`tensor`), queued on a side stream.

    Read `tensor` only after `wait` returned. Until then this holds the copy's source, so the
    device memory being read is not handed to another tensor while the copy runs. `wait` is
    called by the one thread that reads `tensor`.
    """

    def __init__(self, tensor: torch.Tensor, done: Any, source: torch.Tensor) -> None:
        self.tensor = tensor
        self._done = done  # a CUDA event recorded on the side stream after the copy
        self._source: torch.Tensor | None = source

    def wait(self) -> None:
        """Blocks until the copy is in `tensor` (that copy's event alone; no stream is synced)."""
        if self._source is not None:
            self._done.synchronize()
            self._source = None


def to_pinned(tensor: torch.Tensor) -> PinnedCopy:
    """Queues one copy of device `tensor` into a new pinned buffer, behind the work queued so far
    on the caller's current stream; returns at once (see the module docstring)."""
    host = pinned_empty_like(tensor)
    side = copy_stream(tensor.device)
    side.wait_stream(torch.cuda.current_stream(tensor.device))  # a wait on the device, not here
    with torch.cuda.stream(side):
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    return PinnedCopy(host, done, tensor)


def stage_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A host `tensor` copied once into a pinned buffer; a pinned or device tensor as it is."""
    if tensor.device.type != "cpu" or tensor.is_pinned():
        return tensor
    staged = pinned_empty_like(tensor)
    staged.copy_(tensor)
    return staged


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host `tensor` on `device`: through a pinned buffer on CUDA (one DMA queued on the current
    stream, which a pageable source would have synchronized first); as it is on the CPU."""
    if device.type == "cpu":
        return tensor
    if device.type != "cuda":  # no pinned memory to stage through (the meta device of the sync tests)
        return tensor.to(device, non_blocking=True)
    return stage_pinned(tensor).to(device, non_blocking=True)


def device_tensor(
    values: list[int] | list[float] | list[bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small tensor of host `values` on `device` without a stream sync (`to_device`): what
    `torch.tensor(values, device=...)` would make, which on CUDA synchronizes the stream."""
    return to_device(torch.tensor(values, dtype=dtype), device)
