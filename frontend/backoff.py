"""Waiting to try again: a backoff that grows up to a cap and never waits past a give-up time."""

from __future__ import annotations

import asyncio
import time

FIRST_WAIT_S = 0.25
MAX_WAIT_S = 2.0


class Backoff:
    """Waits 0.25 s, then twice as long each time, at most 2 s, until `give_up_s` (monotonic)."""

    def __init__(self, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        self._wait_s = FIRST_WAIT_S

    async def wait(self) -> bool:
        """Wait before the next try; False (without waiting) when that try would start past the
        give-up time."""
        if time.monotonic() + self._wait_s >= self.give_up_s:
            return False
        await asyncio.sleep(self._wait_s)
        self._wait_s = min(2 * self._wait_s, MAX_WAIT_S)
        return True
