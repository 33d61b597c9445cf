"""Keeps a background publish off the step that computes a prompt (a request's first token).

A decode worker that prefills a conversation's next turn itself (`router.local_prefill_max_tokens`)
retains the previous turn's end when that turn finishes, and the next turn reaches its engine a
few milliseconds later. Publishing the retained end to the store (RPCs, copies: the publisher's
thread and the store's process) at that moment competes for the GIL and the cores with the step
that computes the new turn's first token, which is what the client waits for. The publish is
not urgent (the store serves other workers' later requests), so it waits that step out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.engine_loop import EngineLoop

# A conversation's next turn usually reaches the engine within this long after the finish that
# retained its prefix (client, gateway and one gRPC hop); the publish starts no earlier.
SETTLE_S = 0.05
# The longest a publish waits for prompts to be computed: under a steady stream of prompts it
# goes ahead anyway, so publishing never stops.
MAX_WAIT_S = 1.0


class PrefillYield:
    """Owns when a retained prefix's publish may start on a decode worker: `SETTLE_S` after it was
    retained, and once the engine has no prompt waiting for its step (`EngineSnapshot.num_waiting`
    is 0), or `max_wait_s` later at the latest. Called on the publisher's thread; never touches
    the engine thread (it reads the loop's snapshots)."""

    def __init__(
        self,
        loop: EngineLoop,
        settle_s: float = SETTLE_S,
        max_wait_s: float = MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.loop = loop
        self.settle_s = settle_s
        self.max_wait_s = max_wait_s
        self.clock = clock  # `retained_s` is a reading of it
        self.sleep = sleep

    def __call__(self, retained_s: float) -> bool:
        """Return when a publish of a prefix retained at `retained_s` may start; False when it
        starts because the wait ran out (or the loop stopped) with a prompt still waiting."""
        remaining_s = retained_s + self.settle_s - self.clock()
        if remaining_s > 0:
            self.sleep(remaining_s)
        return self.loop.wait_until(lambda snapshot: snapshot.num_waiting == 0, self.max_wait_s)
