"""Which workers a request goes to: the `Router` contract, the least-load and round-robin
policies, and `make_router` (the policy by name; prefix-aware lives in `frontend.prefix_router`).

A router only decides; it never talks to a worker. The app feeds it what it learns (decode
Stats, prefill starts and ends, the prefill workers' cache reports) and asks it for
candidates in order of preference.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from frontend.prefix_index import CacheEvent

RouterPolicy = Literal["prefix_aware", "least_load", "round_robin"]

# A decode worker on the prefill's node goes first while its free share of room is at most this
# far below the best candidate's: the state then never crosses nodes, and the cost is a little
# imbalance. Past it the emptier worker wins (a full node must not hold its own prefills' decodes).
SAME_NODE_MARGIN = 0.25


@dataclass(frozen=True)
class DecodeLoad:
    """A decode worker's free room, as its last `Decode.Stats` reported it."""

    num_free_kv_blocks: int
    num_total_kv_blocks: int
    num_free_state_slots: int
    num_total_state_slots: int

    def free_fraction(self) -> float:
        """Free share of the tighter of the two resources (1.0 = idle, 0.0 = full)."""
        kv = self.num_free_kv_blocks / self.num_total_kv_blocks if self.num_total_kv_blocks > 0 else 0.0
        slots = (
            self.num_free_state_slots / self.num_total_state_slots if self.num_total_state_slots > 0 else 0.0
        )
        return min(kv, slots)


class Router(ABC):
    """Picks workers for a request.

    Contract: thread-safe (`update_workers` may come from a controller thread while the event
    loop routes); cheap (no I/O, called on every request); a worker not in the current pools is
    never returned. `rank_decode` returns every known decode worker, best first, so the caller
    can fall back when one rejects its reservation.
    """

    @abstractmethod
    def update_workers(self, prefill_addresses: Sequence[str], decode_addresses: Sequence[str]) -> None: ...

    @property
    @abstractmethod
    def prefill_addresses(self) -> tuple[str, ...]: ...

    @property
    @abstractmethod
    def decode_addresses(self) -> tuple[str, ...]: ...

    @abstractmethod
    def pick_prefill(
        self, num_prompt_tokens: int, prefix_hashes: Sequence[bytes] = (), exclude: Collection[str] = ()
    ) -> str | None:
        """The prefill worker for a prompt (whose prefix chain is `prefix_hashes`), or None when
        the pool has no reachable worker outside `exclude` (workers this request failed on)."""

    @abstractmethod
    def rank_decode(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        prefix_hashes: Sequence[bytes] = (),
        near: str | None = None,
    ) -> list[str]:
        """Decode workers to try for a reservation, best first; `near` is the prefill worker
        chosen (a decode worker on its node may be preferred: its state then stays on the node)."""

    def update_stores(self, stores: Mapping[str, str]) -> None:  # noqa: B027
        """Each worker's node store (worker address -> store address); unknown ones are ""."""

    def store_of(self, address: str) -> str:
        """The store on `address`'s node, "" when not known."""
        return ""

    def decode_has_room(self, address: str) -> bool:
        """Whether decode worker `address` is believed to have room for one more request (its
        last Stats, less what was reserved since); True when this router does not track load."""
        return True

    def on_prefill_start(self, address: str, num_prompt_tokens: int) -> None:  # noqa: B027
        """A prompt was sent to `address`."""

    def on_prefill_end(self, address: str, num_prompt_tokens: int) -> None:  # noqa: B027
        """The prompt sent to `address` finished (or failed)."""

    def on_decode_reserved(self, address: str) -> None:  # noqa: B027
        """A reservation on `address` was accepted."""

    def observe_decode_load(self, address: str, load: DecodeLoad | None) -> None:  # noqa: B027
        """Fresh Stats from `address`; None when it did not answer."""

    def on_prefix_sent(self, address: str, prefix_hashes: Sequence[bytes]) -> None:  # noqa: B027
        """A prompt with this prefix chain was sent to prefill worker `address`."""

    def observe_cache_events(  # noqa: B027
        self, address: str, instance_id: str, events: Sequence[CacheEvent], snapshot: bool = False
    ) -> None:
        """The prefix events prefill worker `address` (engine `instance_id`) reported; with
        `snapshot`, they are every unit usable there now, replacing what was believed of it."""

    def decode_prefix_match(self, prefix_hashes: Sequence[bytes]) -> dict[str, int]:
        """Prompt tokens of the prefix `prefix_hashes` names each decode worker is believed to
        hold as a usable hit (empty when this router does not track it)."""
        return {}

    def on_decode_retained(self, address: str, block_hash: bytes, num_tokens: int) -> None:  # noqa: B027
        """Decode worker `address` finished a request and keeps its first `num_tokens` tokens
        (whose deepest whole unit is named `block_hash`) as a usable hit."""

    def on_local_prefill_refused(self, address: str, prefix_hashes: Sequence[bytes]) -> None:  # noqa: B027
        """Decode worker `address` holds less of this prefix than `decode_prefix_match` said."""

    def mark_unreachable(self, address: str, reason: str) -> None:  # noqa: B027
        """This gateway could not reach worker `address` (a poll or a request's call failed):
        it is not picked again until `mark_reachable`, or until it leaves the pools."""

    def mark_reachable(self, address: str) -> None:  # noqa: B027
        """Worker `address` answered again."""

    def unreachable(self) -> dict[str, str]:
        """Listed workers this gateway cannot reach now, each with why."""
        return {}


class LeastLoadRouter(Router):
    """Prefill: fewest outstanding prompt tokens sent by this gateway. Decode: most free room.

    Decode room is the free share of the tighter resource (KV blocks or state slots) from the
    last Stats, lowered locally by one slot per accepted reservation until the next Stats.
    Workers that did not answer their last Stats go last; workers never measured go first
    (optimistic, so a new replica gets traffic). Ties rotate round-robin. Given the prefill
    worker chosen (`near`) and the workers' node stores (`update_stores`), decode workers on the
    prefill's node go first while their room is within SAME_NODE_MARGIN of the best's. A worker
    marked unreachable is neither picked nor ranked until it answers again (`mark_reachable`) or
    leaves the pools; a new address starts reachable.
    """

    def __init__(self, prefill_addresses: Sequence[str] = (), decode_addresses: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._prefill: tuple[str, ...] = ()
        self._decode: tuple[str, ...] = ()
        self._outstanding: dict[str, int] = {}
        self._loads: dict[str, DecodeLoad | None] = {}
        self._reserved_since_stats: dict[str, int] = {}
        # One rotation per pool: a shared counter would advance twice per request and, with two
        # workers, always break prefill ties the same way.
        self._prefill_tiebreak = itertools.count()
        self._decode_tiebreak = itertools.count()
        self._stores: dict[str, str] = {}  # worker address -> its node's store address
        self._unreachable: dict[str, str] = {}  # worker address -> why it cannot be reached now
        self.update_workers(prefill_addresses, decode_addresses)

    def update_workers(self, prefill_addresses: Sequence[str], decode_addresses: Sequence[str]) -> None:
        with self._lock:
            self._prefill = tuple(dict.fromkeys(prefill_addresses))
            self._decode = tuple(dict.fromkeys(decode_addresses))
            self._outstanding = {a: self._outstanding.get(a, 0) for a in self._prefill}
            self._loads = {a: self._loads[a] for a in self._decode if a in self._loads}
            self._reserved_since_stats = {a: self._reserved_since_stats.get(a, 0) for a in self._decode}
            listed = {*self._prefill, *self._decode}
            self._unreachable = {a: why for a, why in self._unreachable.items() if a in listed}

    @property
    def prefill_addresses(self) -> tuple[str, ...]:
        return self._prefill

    @property
    def decode_addresses(self) -> tuple[str, ...]:
        return self._decode

    def pick_prefill(
        self, num_prompt_tokens: int, prefix_hashes: Sequence[bytes] = (), exclude: Collection[str] = ()
    ) -> str | None:
        with self._lock:
            return min(
                self._prefill_rotation(exclude), key=lambda a: self._outstanding.get(a, 0), default=None
            )

    def rank_decode(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        prefix_hashes: Sequence[bytes] = (),
        near: str | None = None,
    ) -> list[str]:
        with self._lock:
            return self._near_first(sorted(self._decode_rotation(), key=self._decode_key), near)

    def update_stores(self, stores: Mapping[str, str]) -> None:
        with self._lock:
            self._stores = {a: s for a, s in stores.items() if s}

    def store_of(self, address: str) -> str:
        return self._stores.get(address, "")

    def _near_first(self, ranked: list[str], near: str | None) -> list[str]:
        """`ranked` with the decode workers on `near`'s node (the same store) moved ahead when
        their load allows: room left and a free share within SAME_NODE_MARGIN of the first's.
        No change when `near` is itself a decode worker (colocated: it runs its own prompt)."""
        store = self._stores.get(near or "")
        if not store or not ranked or near in self._decode:
            return ranked
        best = self._decode_key(ranked[0])

        def allows(address: str) -> bool:
            room, free = self._decode_key(address)
            return room == 0 and best[0] == 0 and -free >= -best[1] - SAME_NODE_MARGIN

        local = [a for a in ranked if self._stores.get(a) == store and allows(a)]
        return local + [a for a in ranked if a not in local]

    def _prefill_rotation(self, exclude: Collection[str] = ()) -> list[str]:
        """The reachable prefill workers not in `exclude`, starting one further each call (how
        ties rotate)."""
        return _rotated(self._prefill, next(self._prefill_tiebreak), {*self._unreachable, *exclude})

    def _decode_rotation(self) -> list[str]:
        return _rotated(self._decode, next(self._decode_tiebreak), self._unreachable)

    def mark_unreachable(self, address: str, reason: str) -> None:
        with self._lock:
            if address in self._prefill or address in self._decode:
                self._unreachable[address] = reason

    def mark_reachable(self, address: str) -> None:
        with self._lock:
            self._unreachable.pop(address, None)

    def unreachable(self) -> dict[str, str]:
        with self._lock:
            return dict(self._unreachable)

    def _decode_key(self, address: str) -> tuple[int, float]:
        if address not in self._loads:
            return (0, -1.0)
        load = self._loads[address]
        if load is None:
            return (2, 0.0)
        reserved = self._reserved_since_stats.get(address, 0)
        slots_left = load.num_free_state_slots - reserved
        if slots_left <= 0 or load.num_free_kv_blocks <= 0:
            return (1, 0.0)
        adjusted = DecodeLoad(
            load.num_free_kv_blocks, load.num_total_kv_blocks, slots_left, load.num_total_state_slots
        )
        return (0, -adjusted.free_fraction())

    def decode_has_room(self, address: str) -> bool:
        with self._lock:
            return self._decode_key(address)[0] == 0  # measured with room, or never measured

    def on_prefill_start(self, address: str, num_prompt_tokens: int) -> None:
        with self._lock:
            if address in self._outstanding:
                self._outstanding[address] += num_prompt_tokens

    def on_prefill_end(self, address: str, num_prompt_tokens: int) -> None:
        with self._lock:
            if address in self._outstanding:
                self._outstanding[address] = max(0, self._outstanding[address] - num_prompt_tokens)

    def on_decode_reserved(self, address: str) -> None:
        with self._lock:
            if address in self._reserved_since_stats:
                self._reserved_since_stats[address] += 1

    def observe_decode_load(self, address: str, load: DecodeLoad | None) -> None:
        with self._lock:
            if address in self._reserved_since_stats:
                self._loads[address] = load
                self._reserved_since_stats[address] = 0

    def outstanding_prefill_tokens(self, address: str) -> int:
        return self._outstanding.get(address, 0)


class RoundRobinRouter(LeastLoadRouter):
    """Each request goes one worker further along each pool, whatever the load or cache: the
    baseline the other policies are measured against. Decode candidates keep rotation order."""

    def pick_prefill(
        self, num_prompt_tokens: int, prefix_hashes: Sequence[bytes] = (), exclude: Collection[str] = ()
    ) -> str | None:
        with self._lock:
            return next(iter(self._prefill_rotation(exclude)), None)

    def rank_decode(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        prefix_hashes: Sequence[bytes] = (),
        near: str | None = None,
    ) -> list[str]:
        with self._lock:
            return self._decode_rotation()  # no node preference either: the baseline


def _rotated(pool: Sequence[str], offset: int, skip: Collection[str]) -> list[str]:
    """`pool` less `skip`, rotated by `offset`."""
    kept = [a for a in pool if a not in skip]
    n = len(kept)
    return [kept[(offset + i) % n] for i in range(n)]


def make_router(policy: RouterPolicy, prefix_unit: int) -> Router:
    """The router for `router.policy`; `prefix_unit` is the tokens each prefix hash covers."""
    if policy == "least_load":
        return LeastLoadRouter()
    if policy == "round_robin":
        return RoundRobinRouter()
    if policy == "prefix_aware":
        # Imported here: the prefix-aware router builds on LeastLoadRouter from this module.
        from frontend.prefix_router import PrefixAwareRouter

        return PrefixAwareRouter(prefix_unit=prefix_unit)
    raise ValueError(f"router.policy must be prefix_aware, least_load or round_robin (got {policy!r})")
