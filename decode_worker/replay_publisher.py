"""Keeps each decoding request's state in the node's store as it decodes, so another worker can resume it.

With `decode.replay_window` > 0 the engine hands its replay listener a `ReplayPublish` every
window (engine/replay_publish.py); `offer` only queues it (engine thread). One thread writes
each to the worker's node store, its MLA rows under `<state_key>/replay/<token_start>` and its
KDA part under `<state_key>/replay/<token_start>/kda` (key scheme and encoding:
engine/replay_codec.py), through the store client's one Put path
(`state_codec.write_host_state`: the node's shared-memory arena when there is one), sealed.

Per request, from `begin` to `end`:

* the base state stays in the store: the prompt state the prefill wrote under `<state_key>` is
  no longer released after it is read, and a request this worker resumed from stored state gets
  the state it resumed from written there (`begin(base_states=...)`);
* once a piece carrying a checkpoint is written, the KDA parts of the request's earlier pieces
  are released (the checkpoint supersedes them; MLA rows stay): with the engine's rule (records
  since a checkpoint never outweigh one) a request holds at most about two checkpoints of KDA
  bytes besides its base, however long it decodes;
* every key the request holds here (base and pieces) is renewed every `renew_interval_s` for
  `lease_s`, so a worker that dies leaves state that expires on its own a lease later;
* `end` (finished, aborted, client gone, stream broken) releases them all.

Bounded: at most `max_pending` publishes wait to be written. When the queue is full `offer`
SKIPS the publish and returns False: the engine then does not advance the request's published
end, so its next publish starts where the last written one ended and carries a checkpoint
(drop-to-checkpoint), and the stored pieces still chain without a gap. Writes that fail are
logged and counted; a reader then finds the chain shorter (it resumes from an earlier piece and
recomputes more tokens), rebuilds from an earlier checkpoint when a KDA part is unreadable, or,
if MLA rows are, falls back to re-prefilling. Between a checkpoint's write and the release of the
parts it supersedes a request briefly holds one more checkpoint's worth.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.replay_codec import kda_key, kda_states, mla_states, piece_key
from splitserve.engine.replay_publish import ReplayPublish
from splitserve.engine.state_codec import write_host_state
from splitserve.engine.state_transfer import LayerState
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import StateStoreError

logger = logging.getLogger(__name__)

LEASE_S = 60.0  # every key a running request holds here; renewed well before it runs out
RENEW_INTERVAL_S = 15.0
WRITE_TIMEOUT_S = 30.0


@dataclass
class ReplayPublisherStats:
    """What the publisher did since it started (counters only grow; read from any thread)."""

    num_published: int = 0  # pieces written and sealed
    num_skipped: int = 0  # the queue was full: the next piece carries a checkpoint instead
    num_failed: int = 0  # a write, renewal or release the store refused
    num_bytes: int = 0  # piece bytes written (base states not counted)
    num_tokens: int = 0  # tokens the written pieces cover
    num_kda_released: int = 0  # KDA parts released early: a later checkpoint superseded them


@dataclass
class _Held:
    """One request's keys in this worker's store."""

    state_key: str
    keys: list[str] = field(default_factory=list)  # all it holds (released at the end)
    kda_keys: list[str] = field(default_factory=list)  # its pieces' KDA parts, oldest first


class ReplayStorePublisher:
    """Owns the queue of publishes, the keys of every request it keeps state for, and the thread
    that writes, renews and releases them. Thread-safe: `begin`/`end` from the servicer's
    threads, `offer` from the engine thread (never blocks)."""

    def __init__(
        self,
        client: StateStoreClient,
        worker_id: str,
        *,
        max_pending: int = 64,
        lease_s: float = LEASE_S,
        renew_interval_s: float = RENEW_INTERVAL_S,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.renew_interval_s = renew_interval_s
        self.stats = ReplayPublisherStats()
        self._max_pending = max_pending
        self._held: dict[str, _Held] = {}
        self._pieces: collections.deque[ReplayPublish] = collections.deque()
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()  # never dropped
        self._wake = threading.Condition()
        self._stopping = False
        self._busy = False  # the thread is writing, renewing or releasing something
        self._owns_client = False
        self._thread = threading.Thread(target=self._run, name=f"replay-publisher-{worker_id}", daemon=True)
        self._thread.start()

    # Any thread ---------------------------------------------------------------------------------

    def begin(self, request_id: str, state_key: str, base_states: list[LayerState] | None = None) -> None:
        """Keep `request_id`'s state under `state_key` until `end`; with `base_states`, write
        them there first (a resumed request: the state it resumed from)."""
        with self._wake:
            self._held[request_id] = held = _Held(state_key, [state_key])
            if base_states is not None:
                self._tasks.append(functools.partial(self._write_base, held, base_states))
            else:  # kept where its writer put it: this worker owns it from now on
                self._tasks.append(functools.partial(self._adopt, state_key))
            self._wake.notify()

    def end(self, request_id: str) -> None:
        """The request is over: release every key it holds here (idempotent)."""
        with self._wake:
            held = self._held.pop(request_id, None)
            if held is not None:
                self._tasks.append(functools.partial(self._release, held.keys))
                self._wake.notify()

    def offer(self, publish: ReplayPublish) -> bool:
        """Queue one publish (engine thread: never blocks). False when the queue is full (see
        the module docstring); True when taken, or when its request is kept by no one here."""
        with self._wake:
            if publish.request_id not in self._held:
                return True  # not decoding through a stream of ours (e.g. it just ended)
            if len(self._pieces) >= self._max_pending:
                self.stats.num_skipped += 1
                return False
            self._pieces.append(publish)
            self._wake.notify()
            return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Until nothing is queued (for tests and shutdown); False on timeout."""
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            with self._wake:
                if not self._pieces and not self._tasks and not self._busy:
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Release what every request still holds, stop the thread."""
        with self._wake:
            for held in self._held.values():
                self._tasks.append(functools.partial(self._release, held.keys))
            self._held.clear()
            self._pieces.clear()
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout_s)
        if self._owns_client:
            self.client.close()

    @classmethod
    def attach(cls, loop: EngineLoop, worker_id: str, store_address: str) -> ReplayStorePublisher | None:
        """A publisher of `loop`'s engine's replay pieces to the store at `store_address` (its own
        client), listening from now on; None when the engine keeps no rings or there is no store."""
        if not store_address or not loop.engine.config.replay_window:
            return None
        publisher = cls(StateStoreClient(store_address, timeout_s=10.0), worker_id)
        publisher._owns_client = True
        loop.call(lambda e: e.set_replay_listener(publisher.offer)).result()
        return publisher

    def detach(self, loop: EngineLoop) -> None:
        """Stop listening to `loop`'s engine, then `close`."""
        if loop.alive:
            loop.call(lambda e: e.set_replay_listener(None)).result()
        self.close()

    # The publisher's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        next_renew_s = time.monotonic() + self.renew_interval_s
        while True:
            with self._wake:
                self._wake.wait_for(
                    lambda: self._tasks or self._pieces or self._stopping,
                    max(0.0, next_renew_s - time.monotonic()),
                )
                work: Callable[[], None] | None = None
                if self._tasks:
                    work = self._tasks.popleft()
                elif self._pieces:
                    publish = self._pieces.popleft()
                    work = functools.partial(self._write_piece, publish)
                elif self._stopping:
                    return
                self._busy = work is not None
            if work is not None:
                self._guarded(work)
                with self._wake:
                    self._busy = False
            if time.monotonic() >= next_renew_s:
                self._guarded(self._renew_all)
                next_renew_s = time.monotonic() + self.renew_interval_s

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - a store error or a bug: count it, keep the thread
            self.stats.num_failed += 1
            logger.warning("replay publishing to %s failed: %s", self.client.address, exc)

    def _write_piece(self, publish: ReplayPublish) -> None:
        with self._wake:
            held = self._held.get(publish.request_id)
            if held is None:
                return  # ended while queued
            key, kda = (
                piece_key(held.state_key, publish.token_start),
                kda_key(held.state_key, publish.token_start),
            )
            held.keys += [key, kda]  # before the write: `end` releases even a half-written key
            superseded = list(held.kda_keys) if publish.has_checkpoint else []
            held.kda_keys.append(kda)
        self.stats.num_bytes += self._write(key, mla_states(publish))
        self.stats.num_bytes += self._write(kda, kda_states(publish))
        self.stats.num_published += 1
        self.stats.num_tokens += publish.num_tokens - publish.token_start
        if superseded:  # only once the checkpoint is sealed: a reader always finds one
            with self._wake:
                for old in superseded:
                    held.keys.remove(old)
                    held.kda_keys.remove(old)
            self._release(superseded)
            self.stats.num_kda_released += len(superseded)

    def _write_base(self, held: _Held, states: list[LayerState]) -> None:
        with self._wake:
            if not any(h is held for h in self._held.values()):
                return  # ended before its base was written
        self._write(held.state_key, states)

    def _write(self, key: str, states: list[LayerState]) -> int:
        num_bytes = sum(s.num_bytes for s in states)
        put = self.client.open_put(key, owner=self.worker_id, lease_s=self.lease_s, expected_bytes=num_bytes)
        kept = []  # write_host_state reads these in place until finish
        try:
            for state in states:
                kept.append(write_host_state(put, dataclasses.replace(state, tensor=state.tensor.cpu())))
            put.finish(WRITE_TIMEOUT_S)
        except BaseException:
            put.cancel()
            raise
        return num_bytes

    def _renew_all(self) -> None:
        with self._wake:
            keys = [key for held in self._held.values() for key in held.keys]
        for key in keys:
            try:
                self.client.renew(key, self.lease_s)
            except StateStoreError as exc:  # released meanwhile, or never written: nothing to keep
                logger.debug("could not renew %s: %s", key, exc)

    def _adopt(self, key: str) -> None:
        """Takes over a key another worker wrote (a prefill's prompt state kept in place), so
        everything this worker keeps is its own (a release by owner frees it all)."""
        try:
            self.client.renew(key, self.lease_s, owner=self.worker_id)
        except StateStoreError as exc:  # released meanwhile: nothing to keep
            logger.debug("could not adopt %s: %s", key, exc)

    def _release(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.client.release(key)
            except StateStoreError as exc:
                logger.debug("could not release %s (%s); its lease frees it", key, exc)
