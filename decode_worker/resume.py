"""Decode failover from stored state, the decode worker's side: a Decode with `resume_from`.

The gateway lost the worker that decoded a request; that worker's store still holds the request's
base state and ReplaySSM pieces (decode_worker/replay_publisher.py). This worker reads and
rebuilds them (decode_worker/stored_resume.py), takes the state in as a transfer into a room of
its own (`reserve_transfer` + the sink), and admits the request with every token the client
received: those the state covers as earlier outputs, the next one as the token it continues from,
and the rest (sent after the last piece landed, fewer than `replay_window` when every publish
did) computed again in one chunk, not sampled. The stream then carries only new tokens, so the
client sees none repeated or missing.

Fails with NOT_FOUND (the state is gone), DATA_LOSS (a piece is corrupt or does not chain),
FAILED_PRECONDITION (the store failed) or RESOURCE_EXHAUSTED (no room here): the gateway then
re-prefills instead. Once the state is in, the lost worker's keys are released (nobody else
will) and, with a publisher, this worker keeps its own copy of the base for a next failover.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from decode_worker.replay_publisher import ReplayStorePublisher
from decode_worker.state_reader import StateReader
from decode_worker.stored_resume import StoredState, read_stored_state
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine, RequestUpdate
from splitserve.engine.parallel.handoff import ShardingSink
from splitserve.rpc import abort
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import CorruptStateError, StateStoreError, StateUnavailableError
from splitserve.v1 import decode_pb2
from splitserve.worker.messages import sampling_params_or_abort
from splitserve.worker.token_stream import stream_deltas

logger = logging.getLogger(__name__)


def reserve_room(
    loop: EngineLoop, rid: str, num_tokens: int, context: grpc.ServicerContext, num_samples: int = 1
) -> ShardingSink | None:
    """Room for the state of `num_tokens` tokens (and `num_samples` samples forked from it) and
    where to write it; None when there is no room now. A request the engine refuses ends the RPC
    with INVALID_ARGUMENT."""
    try:
        return loop.call(
            lambda e: e.transfer_sink(rid) if e.reserve_transfer(rid, num_tokens, num_samples) else None
        ).result(timeout=30)
    except ValueError as exc:
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class KeptStreams:
    """The streams of one decode worker whose state its store keeps: owns nothing but the
    publisher's begin/end around each stream, and resuming from another worker's stored state."""

    def __init__(
        self,
        loop: EngineLoop,
        worker_id: str,
        store: StateStoreClient,
        publisher: ReplayStorePublisher | None,
        state_timeout_s: float,
    ) -> None:
        self.loop = loop
        self.worker_id = worker_id
        self.store = store
        self.publisher = publisher
        self.state_timeout_s = state_timeout_s

    def keep(self, rid: str, reader: StateReader) -> tuple[str, str] | None:
        """A handed-off request is admitted: keep its prompt state with its pieces in this
        node's store until the stream ends; (this store's address, state key) to announce, or
        None when this worker publishes nothing. A prompt state read from this node's store is
        kept where it is (not released); one read from another node's store (one hop) is written
        here from the reader's copies (`keep_copies`), and the caller releases the original."""
        if self.publisher is None:
            return None
        if reader.store.address == self.store.address:
            self.publisher.begin(rid, reader.key)
        elif reader.copies is not None:
            self.publisher.begin(rid, reader.key, base_states=reader.copies)
            reader.copies = None  # the publisher's now
        else:
            return None  # read without copies: a failover re-prefills
        return self.store.address, reader.key

    def stream(
        self,
        rid: str,
        updates: queue.Queue[RequestUpdate],
        context: grpc.ServicerContext,
        state_wait_s: float,
        num_generated: int,
        kept_in: tuple[str, str] | None,
    ) -> Iterator[decode_pb2.TokenDelta]:
        """Stream an admitted request's deltas; with `kept_in` = (store address, state key) and a
        publisher, the first delta names them (`resume_from`). Whatever ends the stream (finish,
        abort, the client gone) ends what the publisher keeps of the request."""
        finished = threading.Event()
        context.add_callback(lambda: None if finished.is_set() else self._abort_engine(rid))
        first = True
        try:
            deltas = stream_deltas(
                rid,
                updates,
                finished.set,
                context,
                state_wait_s,
                num_generated,
                engine_alive=self._engine_alive,
            )
            for delta in deltas:
                if first and kept_in is not None and self.publisher is not None:
                    delta.resume_from.store_address, delta.resume_from.state_key = kept_in
                first = False
                yield delta
        finally:
            if self.publisher is not None:
                self.publisher.end(rid)

    def _engine_alive(self) -> bool:
        return bool(self.loop.alive)

    def resume(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenDelta]:
        """A Decode with `resume_from` (see the module docstring)."""
        rid, where = request.request_id, request.resume_from
        prompt, sent = list(request.prompt_token_ids), list(request.output_token_ids)
        params = sampling_params_or_abort(request.sampling_params, context)
        if not sent:
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "resume_from needs the tokens sent (output_token_ids)",
            )
        arrived = time.time()
        stored = self._read(rid, where, len(prompt), len(sent), context)
        n0 = stored.num_tokens
        m = n0 - len(prompt)  # generated tokens the stored state covers
        sink = reserve_room(self.loop, rid, n0, context)
        if sink is None:
            abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks or state slots to resume into"
            )
        try:
            for state in stored.states:
                sink.write(state)
        except (ValueError, StateStoreError, RuntimeError) as exc:
            self._abort_engine(rid)
            abort(context, grpc.StatusCode.DATA_LOSS, f"stored state of {rid} does not fit: {exc}")
        updates: queue.Queue[RequestUpdate] = queue.Queue()
        self.loop.watch(rid, updates.put)
        key = f"{self.worker_id}/{rid}"
        if self.publisher is not None:  # this worker's own copy of the base, for a next failover
            self.publisher.begin(rid, key, base_states=stored.prompt_states)

        def admit(engine: LLMEngine) -> None:
            # sent after the state: computed, not sampled (on every rank of a tensor-parallel engine)
            engine.admit_transferred(
                rid, prompt, params, sent[m], output_token_ids=sent[:m], recomputed_token_ids=sent[m + 1 :]
            )

        try:
            self.loop.call(admit).result(timeout=30)
        except (ValueError, KeyError) as exc:
            self.loop.unwatch(rid)
            self._abort_engine(rid)
            if self.publisher is not None:
                self.publisher.end(rid)
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        logger.info(
            "request %s resumed from %d stored tokens (%d pieces, %d bytes); %d sent tokens recomputed",
            rid,
            n0,
            stored.num_pieces,
            stored.num_bytes,
            len(sent) - m - 1,
        )
        self._release_in_background(where.store_address, stored.keys)  # the lost worker's: done
        own = (self.store.address, key)
        yield from self.stream(rid, updates, context, time.time() - arrived, len(sent), own)

    def _read(
        self,
        rid: str,
        where: decode_pb2.ResumeFrom,
        num_prompt: int,
        num_sent: int,
        context: grpc.ServicerContext,
    ) -> StoredState:
        with self._client(where.store_address) as client:
            try:
                return read_stored_state(
                    client, where.state_key, rid, num_prompt, num_sent, self.state_timeout_s
                )
            except StateUnavailableError as exc:
                abort(context, grpc.StatusCode.NOT_FOUND, f"stored state of {rid} is gone: {exc}")
            except CorruptStateError as exc:
                abort(context, grpc.StatusCode.DATA_LOSS, f"stored state of {rid} is corrupt: {exc}")
            except StateStoreError as exc:
                abort(
                    context, grpc.StatusCode.FAILED_PRECONDITION, f"stored state of {rid} unreadable: {exc}"
                )

    def _client(self, address: str) -> _Borrowed:
        return _Borrowed(self.store if address == self.store.address else None, address)

    def _release_in_background(self, address: str, keys: list[str]) -> None:
        """Release `keys` in the store at `address`, off this thread (their worker is gone, so no
        one else will; a failure leaves them to their leases)."""

        def release() -> None:
            with self._client(address) as client:
                for key in keys:
                    try:
                        client.release(key)
                    except StateStoreError as exc:
                        logger.info("could not release %s in %s (%s); its lease frees it", key, address, exc)

        threading.Thread(target=release, name="release-resumed-state", daemon=True).start()

    def _abort_engine(self, rid: str) -> None:
        self.loop.call(lambda e: e.abort_request(rid))


class _Borrowed:
    """This worker's store client when `address` is its own, else a client of its own, closed on exit."""

    def __init__(self, own: StateStoreClient | None, address: str) -> None:
        self._own = own
        self._client = own or StateStoreClient(address, timeout_s=10.0)

    def __enter__(self) -> StateStoreClient:
        return self._client

    def __exit__(self, *exc: object) -> None:
        if self._own is None:
            self._client.close()
