"""The Decode gRPC service: reserve room, pull state as it lands, join the batch, stream tokens."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from decode_worker.lapses import LapseReaper
from decode_worker.replay_publisher import ReplayStorePublisher
from decode_worker.resume import KeptStreams, reserve_room
from decode_worker.state_reader import StateReader
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine, RequestUpdate
from splitserve.engine.parallel.handoff import ShardingSink, StoreRead
from splitserve.engine.parallel_sampling import SampleStart
from splitserve.rpc import abort
from splitserve.rpc_auth import cluster_token
from splitserve.sampling_params import SamplingParams, sample_request_id
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import CorruptStateError, StateStoreError
from splitserve.state.transport import TransportClient, open_client
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from splitserve.wire import logprobs_from_proto, sampling_params_from_proto
from splitserve.worker.load import decode_stats
from splitserve.worker.messages import sample_ids, sampling_params_or_abort
from splitserve.worker.token_stream import stream_deltas

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """Owns the reservations in flight (one StateReader each) and their deadlines (one reaper thread).

    With a `publisher` (ReplaySSM publishing on) a request's state stays in this node's store while
    it decodes and a Decode with `resume_from` resumes from another worker's (decode_worker/resume.py)."""

    def __init__(
        self,
        loop: EngineLoop,
        worker_id: str,
        store_address: str,
        state_timeout_s: float = 60.0,
        publisher: ReplayStorePublisher | None = None,
    ) -> None:
        self.loop = loop
        self.worker_id = worker_id
        self.store_address = store_address
        self.store = StateStoreClient(store_address, timeout_s=10.0)
        self._sources: dict[str, StateStoreClient] = {}  # other nodes' stores read from (one hop)
        # A transfer engine's reader for other nodes' stores, opened at the first cross-node
        # reservation when this node's store serves one (store.transfer_engine); None: gRPC bytes.
        self.transport: TransportClient | None = None
        self._transport_checked = False
        self._transport_lock = threading.Lock()
        self.state_timeout_s = state_timeout_s
        self._readers: dict[str, StateReader] = {}
        self._lapse_entries: dict[str, int] = {}  # request id -> its reservation's entry in _lapses
        self._lapses = LapseReaper(name=f"lapses-{worker_id}")  # one thread, not one per reservation
        self._lock = threading.Lock()
        self._reservation_ids = itertools.count()  # next() is atomic under the GIL
        self.kept = KeptStreams(loop, worker_id, self.store, publisher, state_timeout_s)

    def close(self) -> None:
        """Stop lapsing reservations; close the channels to this node's store and the stores read
        from, and the transport."""
        self._lapses.close()
        self.store.close()
        with self._lock:
            sources, self._sources = list(self._sources.values()), {}
        for source in sources:
            source.close()
        if self.transport is not None:
            self.transport.close()

    def _source(self, address: str) -> StateStoreClient:
        """The client of the store a reservation's state is written to (empty: this node's)."""
        if not address or address == self.store_address:
            return self.store
        with self._lock:
            if address not in self._sources:
                self._sources[address] = StateStoreClient(address, timeout_s=10.0)
            return self._sources[address]

    def _cross_node_transport(self) -> TransportClient | None:
        """The reader of the transfer engine the cluster's stores serve (asked of this node's
        store once); None, and cross-node state comes as gRPC bytes, when it is "none" or its
        extra cannot load here (said once in the log). A store serving another engine, or none,
        still answers with bytes (`StateStoreClient.get`)."""
        with self._transport_lock:
            if self._transport_checked:
                return self.transport
            try:
                engine = self.store.transfer_engine()
                if engine != "none":
                    host = self.store_address.rsplit(":", 1)[0]  # this node's address
                    self.transport = open_client(engine, host)
                self._transport_checked = True
            except ImportError as exc:
                self._transport_checked = True
                logger.warning("cross-node state will come as gRPC bytes: no transfer engine (%s)", exc)
            except StateStoreError as exc:  # this node's store did not answer: asked again next time
                logger.warning("cross-node state comes as gRPC bytes for now: %s", exc)
            return self.transport

    @property
    def cross_node_transport(self) -> str | None:
        """How other nodes' state reaches this worker: the transfer engine's name, "grpc" (bytes
        over gRPC), or None before its first reservation from another node's store."""
        if not self._transport_checked:
            return None
        return self.transport.engine if self.transport is not None else "grpc"

    def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> decode_pb2.ReserveResponse:
        rid = request.request_id
        sink = reserve_room(self.loop, rid, request.num_prompt_tokens, context, max(1, request.num_samples))
        if sink is None:
            return decode_pb2.ReserveResponse(
                accepted=False, reject_reason="no free KV blocks or state slots"
            )
        # The room is held from here on: every way out below that does not hand it to a reader
        # (whose lapse then bounds it) gives it back at once.
        try:
            reader = self._open_reader(request, context, sink)
        except Exception as exc:
            self._abort_engine(rid)
            if isinstance(exc, StateStoreError):  # e.g. this node's store is down (restarting)
                abort(context, grpc.StatusCode.UNAVAILABLE, f"cannot read state for {rid} now: {exc}")
            raise
        if reader is None:
            return decode_pb2.ReserveResponse(accepted=False, reject_reason="the caller is gone")
        return decode_pb2.ReserveResponse(
            accepted=True,
            store_address=reader.store.address,
            state_key=reader.key,
            state_owner=self.worker_id,
            expiry_unix_s=time.time() + (request.timeout_s or self.state_timeout_s),
        )

    def _open_reader(
        self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext, sink: ShardingSink
    ) -> StateReader | None:
        """Start pulling a granted reservation's state, its lapse armed; None (nothing started)
        when the caller is gone. Raises what opening the read raised (the store unreachable)."""
        rid = request.request_id
        if not context.is_active():  # the caller gave up (its deadline passed): it will never abort it
            self._abort_engine(rid)
            return None
        # One key per reservation: a failover that reserves here again for the same request must
        # not meet the sealed key of an attempt whose read failed (ALREADY_EXISTS for its prefill).
        # A gateway that starts the prefill while reserving names the key itself (one per attempt).
        key = request.state_key or f"{self.worker_id}/{rid}/{next(self._reservation_ids)}"
        timeout_s = request.timeout_s or self.state_timeout_s
        source = self._source(request.source_store_address)
        # the arena only of this node's store: another node's state comes over the network
        shared = None if source is self.store else False
        transport = None if source is self.store else self._cross_node_transport()
        if self.loop.engine.tp.size > 1:  # each other rank reads its heads of the key itself
            read = StoreRead(source.address, key, timeout_s, shared, cluster_token())
            self.loop.call(lambda e: e.read_on_ranks(rid, read)).result(timeout=30)
        reader = StateReader(
            sink,
            source,
            rid,
            key,
            timeout_s,
            self._free_room,
            shared_memory=shared,
            transport=transport,
            keep_copies=source is not self.store and self.kept.publisher is not None,
        )
        with self._lock:
            self._readers[rid] = reader
            # a Decode or Abort for rid cancels it (`_take`); a replaced reader's entry finds it gone
            self._lapse_entries[rid] = self._lapses.add(2 * timeout_s, lambda: self._lapse(rid, reader))
        if reader.failed:  # it failed before it was registered: its callback found nothing to free
            self._free_room(reader)
        return reader

    def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenDelta]:
        rid = request.request_id
        if request.HasField("resume_from"):
            yield from self.kept.resume(request, context)  # decode failover from stored state
            return
        reader = self._take(rid)
        if reader is None and not request.HasField("state"):
            yield from self._decode_whole(request, context)  # no prefill worker: prefill.fallback
            return
        if reader is None:
            abort(
                context, grpc.StatusCode.NOT_FOUND, f"no reservation for request {rid!r}; call Reserve first"
            )
        arrived = time.time()
        try:
            params = sampling_params_from_proto(request.sampling_params)
            reader.wait(self.state_timeout_s)
        except CorruptStateError as exc:
            self._drop(rid, reader)
            abort(context, grpc.StatusCode.DATA_LOSS, f"state of {rid} is corrupt: {exc}")
        except (TimeoutError, StateStoreError, RuntimeError) as exc:
            self._drop(rid, reader)
            abort(context, grpc.StatusCode.UNAVAILABLE, f"state of {rid} could not be read: {exc}")
        except ValueError as exc:  # the sampling params, or state that does not fit the reservation
            self._drop(rid, reader)
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        state_wait_s = time.time() - arrived
        if request.samples:  # n > 1: the samples fork the state on admission
            yield from self._decode_samples(request, context, reader, params, state_wait_s)
            return
        updates: queue.Queue[RequestUpdate] = queue.Queue()
        self.loop.watch(rid, updates.put)
        first_lp = logprobs_from_proto(request.first_logprobs) if request.HasField("first_logprobs") else None
        prompt, first = list(request.prompt_token_ids), request.first_token_id
        earlier = list(request.output_token_ids)  # failover: generated before `first` elsewhere
        try:
            self.loop.call(
                lambda e: e.admit_transferred(rid, prompt, params, first, first_lp, output_token_ids=earlier)
            ).result(timeout=30)
        except (ValueError, KeyError) as exc:
            self._drop(rid, reader)
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        kept_in = self.kept.keep(rid, reader)  # with a publisher: kept until the stream ends
        if kept_in is None or reader.store is not self.store:  # another node's: copied here, if kept
            self._release(reader)
        yield from self.kept.stream(rid, updates, context, state_wait_s, 1 + len(earlier), kept_in)

    def _decode_samples(
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.ServicerContext,
        reader: StateReader,
        params: SamplingParams,
        state_wait_s: float,
    ) -> Iterator[decode_pb2.TokenDelta]:
        """A Decode of several samples (n > 1) whose prompt state has arrived: the samples their
        first token did not end join the batch, each forking the one state read (its whole KV
        blocks shared), and stream on one call, each delta naming its sample. The state is read
        once for all and released at once: nothing here keeps it for a stored-state resume (a
        lost sample re-prefills as a request of its own)."""
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        starts = [
            SampleStart(
                s.token_id,
                logprobs_from_proto(s.logprobs) if s.HasField("logprobs") else None,
                finished=s.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED,
            )
            for s in request.samples
        ]
        live = {i: 1 for i, start in enumerate(starts) if not start.finished}
        updates: queue.Queue[RequestUpdate] = queue.Queue()
        for i in live:
            self.loop.watch(sample_request_id(rid, i), updates.put)
        try:
            self.loop.call(lambda e: e.admit_transferred_samples(rid, prompt, params, starts)).result(
                timeout=30
            )
        except (ValueError, KeyError) as exc:
            for i in live:
                self.loop.unwatch(sample_request_id(rid, i))
            self._drop(rid, reader)
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._release(reader)
        finished = threading.Event()
        context.add_callback(lambda: None if finished.is_set() else self._abort_engine(rid))
        yield from stream_deltas(
            rid,
            updates,
            finished.set,
            context,
            state_wait_s,
            samples=live,
            engine_alive=lambda: self.loop.alive,
        )

    def _decode_whole(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.TokenDelta]:
        """A Decode with no state: this engine computes the prompt itself and streams every token,
        the first one included (its delta says how many prompt tokens its prefix cache served).
        Two callers: a local prefill (`max_uncached_tokens` > 0: the gateway believes this
        worker's cache holds all but a short suffix of the prompt; when it holds less, the answer
        is FAILED_PRECONDITION and nothing starts), and `prefill.fallback: decode_local` (the
        prefill pool is empty; no limit). After a decode failover it computes prompt +
        `output_token_ids` and streams from there."""
        rid, prompt, sent = request.request_id, list(request.prompt_token_ids), list(request.output_token_ids)
        params = sampling_params_or_abort(request.sampling_params, context)
        chain = list(request.prefix_hashes) or None  # None: the engine names the prompt itself
        limit = request.max_uncached_tokens
        updates: queue.Queue[RequestUpdate] = queue.Queue()
        ids = sample_ids(rid, params)  # n > 1: this engine draws every sample's first token too
        for engine_id in ids:
            self.loop.watch(engine_id, updates.put)

        def add(engine: LLMEngine) -> int:
            """Adds the request unless too much of its prompt is uncached; the uncached tokens.
            One trip to the engine thread: the hit cannot change between the check and the add."""
            uncached = len(prompt) - engine.num_cached_prompt_tokens(prompt, chain) if limit else 0
            if uncached <= limit:
                engine.add_request(rid, prompt, params, output_token_ids=sent, prefix_hashes=chain)
            return uncached

        try:
            uncached = self.loop.call(add).result(timeout=30)
        except ValueError as exc:
            for engine_id in ids:
                self.loop.unwatch(engine_id)
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if uncached > limit:
            for engine_id in ids:
                self.loop.unwatch(engine_id)
            abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{uncached} of the prompt's {len(prompt)} tokens are not in this worker's prefix "
                f"cache (a local prefill takes at most {limit}): prefill it on a prefill worker",
            )
        finished = threading.Event()
        context.add_callback(lambda: None if finished.is_set() else self._abort_engine(rid))
        samples = {i: len(sent) for i in range(len(ids))} if len(ids) > 1 else None
        yield from stream_deltas(
            rid,
            updates,
            finished.set,
            context,
            num_generated=len(sent),
            samples=samples,
            engine_alive=lambda: self.loop.alive,
        )

    def _free_room(self, reader: StateReader) -> None:
        """The state will never arrive whole: free the room now; Decode still reports why.

        Only while the reservation is still pending: once a Decode or an Abort took the reader,
        the taker frees the room itself, and the request id may already name a new request here
        (the gateway runs the prompt again, e.g. `decode_local` after the prefill's store failed)
        that an abort by id from this late callback would end silently, its stream left waiting.
        The abort is queued under the lock, so an Abort or Decode taking the reader meanwhile
        queues its own work after it."""
        with self._lock:
            if self._readers.get(reader.request_id) is not reader:
                return
            self._abort_engine(reader.request_id)
        self._release(reader)

    def _take(self, rid: str) -> StateReader | None:
        """The reservation's reader, no longer pending (its lapse cancelled), or None."""
        with self._lock:
            entry = self._lapse_entries.pop(rid, None)
            reader = self._readers.pop(rid, None)
        if entry is not None:
            self._lapses.cancel(entry)
        return reader

    def _lapse(self, rid: str, reader: StateReader) -> None:
        """No Decode came for a reservation in time: give its room and its state back."""
        with self._lock:
            if self._readers.get(rid) is not reader:
                return
            del self._readers[rid]
            self._lapse_entries.pop(rid, None)
        logger.warning("reservation %s lapsed without a Decode call", rid)
        self._drop(rid, reader)

    def _drop(self, rid: str, reader: StateReader) -> None:
        reader.cancel()
        self._abort_engine(rid)
        self._release(reader)

    def _release(self, reader: StateReader) -> None:
        try:
            reader.release()
        except StateStoreError as exc:
            logger.warning("could not release state %s (%s); its lease will free it", reader.key, exc)

    def _abort_engine(self, rid: str) -> None:
        self.loop.call(lambda e: e.abort_request(rid))

    def Abort(
        self, request: decode_pb2.AbortDecodeRequest, context: grpc.ServicerContext
    ) -> decode_pb2.AbortDecodeResponse:
        rid = request.request_id
        reader = self._take(rid)
        found = self.loop.call(lambda e: e.has_request(rid)).result(timeout=30)
        if reader is not None:
            self._drop(rid, reader)
        else:
            self._abort_engine(rid)
        return decode_pb2.AbortDecodeResponse(found=found or reader is not None)

    def Stats(
        self, request: decode_pb2.DecodeStatsRequest, context: grpc.ServicerContext
    ) -> decode_pb2.DecodeStats:
        return decode_stats(self.loop.snapshot())  # the last pass's: no wait behind a step
