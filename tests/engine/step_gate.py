"""Test helpers: an engine step that blocks until the test lets it go, and a clock tests move."""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any


class StepGate:
    """While entered, `engine.step()` signals `entered` and blocks until `release` is set (or the
    gate is left); then it runs the real step. A long prefill chunk, without waiting for one."""

    def __init__(self, engine: Any, wait_s: float = 60.0) -> None:
        self.engine = engine
        self.entered = threading.Event()
        self.release = threading.Event()
        self._wait_s = wait_s

    def _step(self) -> Any:
        self.entered.set()
        if not self.release.wait(self._wait_s):
            raise TimeoutError(f"the test never released the engine's step within {self._wait_s:g} s")
        return type(self.engine).step(self.engine)

    def __enter__(self) -> StepGate:
        self.engine.step = self._step  # the loop calls engine.step(): the instance attribute wins
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release.set()
        del self.engine.step


class FakeClock:
    """A monotonic clock that only moves when the test says (`advance`)."""

    def __init__(self) -> None:
        # whole seconds: `start + 1000.0 - start` is then exactly 1000.0 (from an arbitrary
        # monotonic reading it need not be, e.g. when the sum crosses a power of two)
        self.now_s = float(int(time.monotonic()))

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
