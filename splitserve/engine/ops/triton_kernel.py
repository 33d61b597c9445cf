"""How the engine's Triton kernels are built, chosen, stood in for, and replaced when one fails to build.

* `TritonKernel(name, fn, do_not_specialize)`: `kernel[grid](...)` decorates `fn` with `triton.jit` on
  first use, once per interpreter mode (triton decides between compiling and interpreting when a
  function is decorated, and `TRITON_INTERPRET=1` runs the same kernel on CPU tensors, which is how
  the CPU tests check each kernel against its torch reference).
* `stand_in(factory)`: while it is active every `TritonKernel` launch goes to
  `factory(kernel)[grid](...)` instead: the CPU tests stub the launches (the torch code around them
  still runs, under FakeTensorMode) and experiments/decode_launches.py counts them.
* `fused_backend(device)`: where the layers' fused glue kernels run (norms, KDA decode gates, the
  router): `"triton"` on a CUDA device with triton importable, `"torch"` (the reference every CPU
  step runs) elsewhere; `SPLITSERVE_FUSED_BACKEND=torch|triton` forces either.
* `kernel_or_torch(name, kernel_call, torch_call)`: `kernel_call()` unless kernel `name` failed
  before; a failure (a kernel that does not build here) is logged once and its torch reference
  runs from then on, so a broken kernel costs launches, never the step.

Nothing here imports triton: a CPU node without it never builds a kernel.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from splitserve.engine.ops.backend import choose_backend, importable

logger = logging.getLogger(__name__)

FUSED_BACKEND_ENV = "SPLITSERVE_FUSED_BACKEND"
T = TypeVar("T")
_stand_in: Callable[[TritonKernel], Any] | None = None
_failed: set[str] = set()


class TritonKernel:
    """One Triton kernel, jitted on first launch; `kernel[grid](*args, **meta)` launches it."""

    def __init__(self, name: str, fn: Callable[..., Any], do_not_specialize: tuple[str, ...] = ()) -> None:
        self.name = name
        self.fn = fn
        # integer parameters that vary per request (context widths, lengths): triton compiles one binary
        # for every value class of a specialised one (1, a multiple of 16, other), so an unlisted one
        # can compile inside a request; listed, one binary serves all
        self.do_not_specialize = do_not_specialize
        self._jitted: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Any:
        if _stand_in is not None:
            return _stand_in(self)[grid]
        return self.jitted()[grid]

    def jitted(self) -> Any:
        import triton
        from triton import knobs

        interpret = bool(knobs.runtime.interpret)
        if interpret not in self._jitted:
            self._jitted[interpret] = triton.jit(self.fn, do_not_specialize=list(self.do_not_specialize))
        return self._jitted[interpret]


@contextlib.contextmanager
def stand_in(factory: Callable[[TritonKernel], Any]) -> Iterator[None]:
    """Every `TritonKernel` launch goes to `factory(kernel)[grid](...)` until the block ends."""
    global _stand_in
    previous, _stand_in = _stand_in, factory
    try:
        yield
    finally:
        _stand_in = previous


def fused_backend(device: torch.device) -> str:
    """`triton` on a CUDA device with triton installed, else `torch`; the env var overrides."""
    return choose_backend(FUSED_BACKEND_ENV, "triton", importable("triton"), "pip install triton", device)


def kernel_or_torch(name: str, kernel_call: Callable[[], T], torch_call: Callable[[], T]) -> T:
    """`kernel_call()`, or `torch_call()` once kernel `name` has failed (logged the first time)."""
    if name not in _failed:
        try:
            return kernel_call()
        except Exception:  # a build error costs launches, not the step: the reference gives the same result
            logger.exception("the %s Triton kernel failed; its torch reference runs from now on", name)
            _failed.add(name)
    return torch_call()
