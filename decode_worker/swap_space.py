"""The decode worker's swap space: preempted requests' states parked in its node's store.

With `preemption_mode: swap`, the engine's swapper hands each swapped-out request's state here
(engine/swap_space.py). It is written to the node's store under a key of its own (the handoff's
piece encoding, `state_codec`; through the store's shared-memory arena on the node), sealed,
and read back and released when the request is admitted again. So swapped states live in the
store's memory (spilling to its disk), not in the worker's, and a store that is full or down
costs only a recompute.

Runs on the engine thread (the swapper calls it between steps): each put and take is one
store round trip plus one copy of the state, bounded by `timeout_s`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.state_codec import decode, write_host_state
from splitserve.engine.state_transfer import LayerState
from splitserve.state.client import StateStoreClient

if TYPE_CHECKING:
    from splitserve.engine.engine_loop import EngineLoop

logger = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 10.0
# A swapped request waits in the engine's queue; a lease this long outlives any sane wait, and a
# state the store expired or evicted anyway is recomputed.
LEASE_S = 3600.0


@dataclass
class StoreSwapStats:
    """What the store-backed swap space did since it started (counters only grow)."""

    num_puts: int = 0
    num_takes: int = 0
    num_put_failures: int = 0  # the store refused or failed the write: recomputed instead
    num_take_failures: int = 0  # the state could not be read back whole: recomputed instead
    num_bytes: int = 0  # state bytes written


class StoreSwapSpace:
    """Owns one request id -> store key map and the keys it wrote (owned by the worker, so a
    restarted worker's release frees them). Promises: `put` and `take` never raise; a failure is
    logged, counted and returned as False / None, and the key is released."""

    def __init__(
        self,
        client: StateStoreClient,
        owner: str,
        timeout_s: float = CLIENT_TIMEOUT_S,
        lease_s: float = LEASE_S,
    ) -> None:
        self.client = client
        self.owner = owner
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.stats = StoreSwapStats()
        self._name = uuid.uuid4().hex[:12]  # keys unique across engines sharing a store
        self._seq = itertools.count()
        self._keys: dict[str, str] = {}

    def put(self, request_id: str, states: list[LayerState]) -> bool:
        key = f"swap-{self._name}-{next(self._seq)}-{request_id}"
        num_bytes = sum(state.num_bytes for state in states)
        try:
            put = self.client.open_put(key, owner=self.owner, lease_s=self.lease_s, expected_bytes=num_bytes)
            try:
                held = []  # the put reads these in place until finish
                for state in states:
                    held.append(write_host_state(put, dataclasses.replace(state, tensor=state.tensor.cpu())))
                put.finish(self.timeout_s)
            except BaseException:
                put.cancel()
                raise
        except Exception as exc:  # noqa: BLE001 - any store failure: this request is recomputed
            self.stats.num_put_failures += 1
            logger.warning(
                "swapping %s out to the store at %s failed: %s", request_id, self.client.address, exc
            )
            self._release(key)
            return False
        self._keys[request_id] = key
        self.stats.num_puts += 1
        self.stats.num_bytes += num_bytes
        return True

    def take(self, request_id: str) -> list[LayerState] | None:
        key = self._keys.pop(request_id, None)
        if key is None:
            return None
        try:
            # `decode` copies each state out of the chunks (the arena's memory goes back at release)
            states = list(decode(self.client.get(key, timeout_s=self.timeout_s)))
        except Exception as exc:  # noqa: BLE001 - lost, expired, corrupt or unreachable: recompute
            self.stats.num_take_failures += 1
            logger.warning(
                "swapping %s in from the store at %s failed: %s", request_id, self.client.address, exc
            )
            return None
        finally:
            self._release(key)
        self.stats.num_takes += 1
        return states

    def drop(self, request_id: str) -> None:
        key = self._keys.pop(request_id, None)
        if key is not None:
            self._release(key)

    def close(self) -> None:
        """Release every state still parked (the worker is stopping) and close the client."""
        for request_id in list(self._keys):
            self.drop(request_id)
        self.client.close()

    def _release(self, key: str) -> None:
        try:
            self.client.release(key)
        except Exception as exc:  # noqa: BLE001 - its lease frees it later anyway
            logger.debug("releasing swap key %s failed: %s", key, exc)


def attach_store_swap_space(loop: EngineLoop, owner: str, store_address: str) -> StoreSwapSpace | None:
    """Make the store at `store_address` the swap space of `loop`'s engine when it preempts by
    swap (a client of its own, closed by `close`); None (nothing changed) when it recomputes."""
    if loop.engine.config.preemption_mode != "swap":
        return None
    space = StoreSwapSpace(StateStoreClient(store_address, timeout_s=CLIENT_TIMEOUT_S), owner)
    loop.call(lambda engine: engine.set_swap_space(space)).result()
    return space
