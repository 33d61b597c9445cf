"""The Prefill gRPC service: runs a prompt on the engine, streams its state to the decode
target's store as it becomes final (each chunk's MLA rows as that chunk finishes each layer, the
KDA states after the last chunk), returns the first token once the state is sealed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from prefill_worker.prefix_reuse import PrefixReuse
from prefill_worker.state_writer import NoStateWriter, StateWriter
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import HANDOFF, LLMEngine, RequestUpdate
from splitserve.engine.prefix_cache.imported import ImportedPrefix
from splitserve.engine.state_transfer import state_bytes
from splitserve.rpc import abort
from splitserve.state.client import StateStoreClient
from splitserve.state.errors import StateStoreError
from splitserve.state.status import status_code
from splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from splitserve.worker.cache_report import CacheReporter
from splitserve.worker.messages import (
    first_token_response,
    sample_ids,
    sample_start,
    sampling_params_or_abort,
)

logger = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Owns in-flight bookkeeping and, with prefix caching on and a node store, the worker's side
    of the cluster prefix cache (`PrefixReuse`); the engine loop owns the engine."""

    def __init__(
        self, loop: EngineLoop, worker_id: str, request_timeout_s: float = 300.0, store_address: str = ""
    ) -> None:
        self.loop = loop
        self.worker_id = worker_id
        self.request_timeout_s = request_timeout_s
        self.store_address = store_address  # this node's store: the arena is used for it only
        self._stores: dict[str, StateStoreClient] = {}  # one per decode target's store, kept open
        self._lock = threading.Lock()
        self._cache_reporter = CacheReporter()
        self.prefixes = (
            PrefixReuse(loop, worker_id, store_address) if PrefixReuse.enabled(loop, store_address) else None
        )

    def _store(self, address: str) -> StateStoreClient:
        with self._lock:
            if address not in self._stores:
                self._stores[address] = StateStoreClient(address)
            return self._stores[address]

    def close(self) -> None:
        """Stop publishing prefixes; close the channels to every store this worker wrote to."""
        if self.prefixes is not None:
            self.prefixes.close()
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()

    def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        arrival = time.time()
        rid = request.request_id
        params = sampling_params_or_abort(request.sampling_params, context)
        # A request that ends on its first token needs no decode, so no state target either.
        needs_state = params.max_tokens != 1 or bool(request.state_key)
        if needs_state and (not request.store_address or not request.state_key):
            abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "store_address and state_key are required unless max_tokens is 1",
            )
        writer: StateWriter | NoStateWriter = NoStateWriter()
        export = None  # without one the engine runs an ordinary request, ended by max_tokens 1
        if needs_state:
            owner = request.state_owner or self.worker_id
            num_state_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            num_ranks = self.loop.engine.tp.size  # each rank's KDA heads go in
            num_bytes = state_bytes(self.loop.engine.caches, num_state_tokens, num_ranks)
            # another node's store (two hops) gets bytes even where its arena could be mapped
            shared = None if request.store_address == self.store_address or not self.store_address else False
            try:
                writer = StateWriter(
                    self._store(request.store_address),
                    request.state_key,
                    owner,
                    request.lease_s,
                    num_bytes,
                    shared_memory=shared,
                )
            except StateStoreError as exc:  # e.g. UNAVAILABLE: the store is down (the gateway retries)
                abort(context, status_code(exc), f"writing state to {request.store_address} failed: {exc}")
            export = writer.write
        done = threading.Event()
        ids = sample_ids(rid, params)  # n > 1: every sample ends on its first token, drawn here
        results: dict[str, RequestUpdate] = {}

        def on_update(update: RequestUpdate) -> None:
            if update.finished:
                results[update.request.request_id] = update
                if len(results) == len(ids):
                    done.set()

        for engine_id in ids:
            self.loop.watch(engine_id, on_update)
        prompt, sent = list(request.prompt_token_ids), list(request.output_token_ids)  # sent: failover
        chain, stored = list(request.prefix_hashes) or None, None  # None: the engine hashes the prompt
        if self.prefixes is not None:  # a prefix the stores hold further than the engine streams in
            chain = self.prefixes.chain_of(prompt, chain)
            stored = self.prefixes.lookup(chain, prompt, request.store_address)

        def add(engine: LLMEngine, state: ImportedPrefix | None) -> None:
            engine.add_request(
                rid,
                prompt,
                params,
                export=export,
                output_token_ids=sent,
                prefix_hashes=chain,
                imported_prefix=state,
            )

        def add_unless_worth_reading(engine: LLMEngine) -> bool:
            # One trip to the engine thread when nothing is read: the comparison with the
            # engine's own hit and the add happen together (a busy engine answers between steps)
            prefixes = self.prefixes
            if (
                stored is not None
                and prefixes is not None
                and prefixes.worth_reading(engine, stored, chain or [], prompt)
            ):
                return False
            add(engine, None)
            return True

        try:
            if not self.loop.call(add_unless_worth_reading).result():
                assert self.prefixes is not None and stored is not None
                imported = self.prefixes.read(stored, chain or [])  # off the engine thread
                self.loop.call(lambda e: self._add_with(e, add, imported)).result()
        except ValueError as exc:
            for engine_id in ids:
                self.loop.unwatch(engine_id)
            writer.cancel()
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        context.add_callback(lambda: None if done.is_set() else self._abort(rid))
        started = time.time()
        if not done.wait(self.request_timeout_s):
            self._abort(rid)
            writer.cancel()
            abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid} did not finish in time")
        updates = [results[engine_id] for engine_id in ids]
        update = updates[0]
        queue_s = update.queue_s or 0.0
        prefill_s = max(0.0, time.time() - started - queue_s)  # from its first schedule
        put_started = time.time()
        try:
            writer.finish(timeout_s=30.0)
        except StateStoreError as exc:  # the store's own status (DATA_LOSS, RESOURCE_EXHAUSTED...) travels on
            abort(context, status_code(exc), f"writing state to {request.store_address} failed: {exc}")
        put_s = time.time() - put_started
        stream_s = writer.stream_s()
        ended = [None if u.request.finish_reason == HANDOFF else u.request.finish_reason for u in updates]
        if "abort" in ended:
            abort(context, grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
        reason = None if None in ended else ended[0]  # a decode follows unless every sample ended
        timing = prefill_pb2.PrefillTiming(
            arrival_unix_s=arrival,
            queue_s=queue_s,
            prefill_s=prefill_s,
            state_put_s=put_s,
            state_bytes=writer.num_bytes,
            state_stream_s=stream_s,
        )
        response = first_token_response(update, reason, timing)
        if len(updates) > 1:
            response.samples.extend(sample_start(u, why) for u, why in zip(updates, ended))
        if reason is None:
            response.state.CopyFrom(
                common_pb2.StateHandle(
                    store_address=request.store_address,
                    key=request.state_key,
                    owner=writer.owner,
                    num_layers=len(self.loop.engine.model_config.layer_types),
                )
            )
        else:  # finished on its first token: nobody will read the state
            writer.release()
        return response

    def _add_with(
        self,
        engine: LLMEngine,
        add: Callable[[LLMEngine, ImportedPrefix | None], None],
        imported: ImportedPrefix | None,
    ) -> None:
        """Add the request with the state a store gave (engine thread); if the engine refuses
        that state, add it without: a stored prefix never fails a request, it is computed."""
        try:
            add(engine, imported)
        except ValueError as exc:
            if imported is None or self.prefixes is None:
                raise
            self.prefixes.refused(exc)
            add(engine, None)

    def _abort(self, request_id: str) -> None:
        self.loop.call(lambda e: e.abort_request(request_id))

    def CacheReport(
        self, request: prefill_pb2.CacheReportRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.PrefixCacheReport:
        return self._cache_reporter.report(self.loop, request)  # no wait behind a step

    def Abort(
        self, request: prefill_pb2.AbortPrefillRequest, context: grpc.ServicerContext
    ) -> prefill_pb2.AbortPrefillResponse:
        rid = request.request_id
        found = self.loop.call(lambda e: e.has_request(rid)).result()
        self._abort(rid)
        return prefill_pb2.AbortPrefillResponse(found=found)
