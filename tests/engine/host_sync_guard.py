"""A CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`: code under test runs with its "device"
tensors on the meta device (shapes, no data) and its host tensors on the CPU, so every crossing
between them is visible, and each that would make the host wait for a CUDA stream fails:

* a read of device values (`.item()`, `.tolist()`, `bool()`, `nonzero`, a boolean-mask index: on the
  meta device these have no data to read, and raise);
* a blocking copy either way (`.to(device)`, `copy_` without `non_blocking=True`; on CUDA a pageable
  or blocking copy synchronizes the stream), and `torch.tensor(..., device=...)` / `torch.as_tensor`
  onto the device (a blocking copy on CUDA; on meta torch builds it without one, so it is caught here).

Non-blocking copies are counted (`host_to_device`, `device_to_host`); a device-to-host one is skipped
(meta holds nothing to copy). Device tensors never have values, so the test asserts on what ran and
on shapes; the tokens themselves are checked by the CPU engine tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")


class HostSyncError(AssertionError):
    """Something in the step would make the host wait for the device."""


def _device(x: Any) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class NoHostSync(TorchDispatchMode):
    """Fails on every host sync between the CPU and `DEVICE` (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.host_to_device = 0
        self.device_to_host = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # under inference_mode composites (`to`) reach the mode whole: check their parts
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = func.overloadpacket.__name__
        reads = name in ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2")
        if reads and any(_device(a) == DEVICE for a in args):
            raise HostSyncError(f"{func} reads device values on the host")
        if name == "_to_copy":
            src, dst = _device(args[0]), kwargs.get("device", _device(args[0]))
            return self._copy(func, args, kwargs, src, dst, bool(kwargs.get("non_blocking", False)))
        if name == "copy_":
            dst, src = _device(args[0]), _device(args[1])
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            return self._copy(func, args, kwargs, src, dst, non_blocking)
        return func(*args, **kwargs)

    def _copy(self, func: Any, args: Any, kwargs: Any, src: Any, dst: Any, non_blocking: bool) -> Any:
        if src == dst or DEVICE not in (src, dst):
            return func(*args, **kwargs)
        if not non_blocking:
            raise HostSyncError(f"{func} from {src} to {dst} blocks (on CUDA it synchronizes the stream)")
        if dst == DEVICE:
            self.host_to_device += 1
            return func(*args, **kwargs)
        self.device_to_host += 1  # meta holds no values: the copy is only counted
        if func.overloadpacket.__name__ == "copy_":
            return args[0]
        return torch.empty(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)


def _refuse_device_literal(original: Any) -> Any:
    def checked(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device) == DEVICE:
            raise HostSyncError(f"{original.__name__}(..., device={device}) is a blocking copy on CUDA")
        return original(*args, **kwargs)

    return checked


def _refuse_read(what: str) -> Any:
    original = getattr(torch.Tensor, what)

    def checked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.device == DEVICE:
            raise HostSyncError(f"Tensor.{what}() reads device values on the host")
        return original(self, *args, **kwargs)

    return checked


@contextlib.contextmanager
def no_host_sync() -> Iterator[NoHostSync]:
    """Run the block as `torch.cuda.set_sync_debug_mode("error")` would, with `DEVICE` for CUDA."""
    mode = NoHostSync()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch, "tensor", _refuse_device_literal(torch.tensor)))
        stack.enter_context(mock.patch.object(torch, "as_tensor", _refuse_device_literal(torch.as_tensor)))
        for what in ("tolist", "item"):
            stack.enter_context(mock.patch.object(torch.Tensor, what, _refuse_read(what)))
        stack.enter_context(mode)
        yield mode
