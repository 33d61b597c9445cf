"""Decode failover from stored state, the workers' side over real gRPC: a decode worker with
`replay_window` keeps the request's prompt state and publishes a ReplaySSM piece every window to
its node's store; when its process is SIGKILLed mid-stream (nothing released), another decode
worker given `resume_from` rebuilds the state from the store, recomputes fewer than a window of
the tokens sent, and continues with exactly the offline engine's tokens (greedy and seeded). A
corrupt piece answers DATA_LOSS and a released state NOT_FOUND (the gateway then re-prefills);
a request that ends normally leaves nothing in the store.

The worker killed runs in a process of its own (`_decode_process`), its engine held still once
the request has NUM_BEFORE_LOSS tokens, so the kill lands mid-stream at a known token. The
tests that inspect the lost worker's publisher (a corrupt piece, a released state, a long
decode) run it in this process and cut its stream instead, its publisher told to release
nothing, as a dead process would not."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import grpc
import pytest

from decode_worker.actor import DecodeWorkerActor
from decode_worker.stored_resume import read_stored_state
from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM, SamplingParams
from splitserve.engine.replay_codec import kda_key, piece_key
from splitserve.engine_config import EngineConfig
from splitserve.rpc import make_channel
from splitserve.state import Chunk, ChunkMeta, StateKind, checksum
from splitserve.state.client import StateStoreClient
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from splitserve.wire import FINISH_FROM_PROTO, decode_request, prefill_request, sampling_params_to_proto
from state_store.config import StoreConfig
from state_store.server import StateStoreServer
from state_store.store import StateStore

WINDOW = 4
PROMPT = list(range(11, 80))
NUM_TOKENS = 24
LOST: set[str] = set()  # request ids whose worker a (in this process) is "dead"
NUM_BEFORE_LOSS = 11  # tokens the lost worker sent: 2 pieces (8 tokens) stored, 3 sent after
KILLED = "killed-worker"  # the worker id of the decode worker process a test kills
START_S = 120.0  # a guard on a worker process's start (it imports torch, loads the model)
WAIT_S = 30.0  # a guard against a hang, not a latency bound
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=33, max_tokens=NUM_TOKENS, ignore_eos=True)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}


@pytest.fixture(scope="module")
def offline(engine_config) -> dict[str, list[int]]:
    """The uninterrupted run's tokens, from the offline engine (both kinds in one batch)."""
    outputs = LLM(model=engine_config.model, max_model_len=512).generate(
        prompt_token_ids=[PROMPT, PROMPT], sampling_params=[GREEDY, SEEDED]
    )
    return {"greedy": outputs[0].outputs[0].token_ids, "seeded": outputs[1].outputs[0].token_ids}


def _start(engine_config, prefill_store: str, decode_store: str) -> dict[str, Any]:
    """A prefill worker on `prefill_store`, two decode workers publishing every WINDOW tokens
    on `decode_store` (another node's store, or the same)."""
    replay = engine_config.replace(replay_window=WINDOW)
    workers: dict[str, Any] = {
        "prefill": PrefillWorkerActor(engine_config, prefill_store),
        "a": DecodeWorkerActor(replay, decode_store),
        "b": DecodeWorkerActor(replay, decode_store),
    }
    for name, worker in workers.items():
        worker.worker_id = f"{name}-worker"  # one process: the default ids (host, pid) would be equal
        worker.start("127.0.0.1", 0)
    # A dead process releases nothing: worker a's publisher does not hear of the end of a stream
    # this test lost on purpose (until `_end_on_a`, which does what the leases would).
    publisher = workers["a"].replay_publisher
    assert publisher is not None
    ended = publisher.end
    publisher.end = lambda rid: None if rid in LOST else ended(rid)  # type: ignore[method-assign]
    return workers


@pytest.fixture(scope="module")
def workers(engine_config, store_server) -> Iterator[dict[str, Any]]:
    """The workers of one node: one store."""
    workers = _start(engine_config, store_server[1], store_server[1])
    yield workers
    for worker in workers.values():
        worker.shutdown()


def _serve_store(conn: Connection) -> None:
    """A store process (`other_store`): sends its address on `conn`, serves until SIGTERMed,
    then stops and frees its arena."""
    store = StateStore.from_config(StoreConfig(memory_bytes=64 << 20))
    server = StateStoreServer(store, "127.0.0.1", 0)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # wakes pause(): a clean stop
    conn.send(server.address)
    signal.pause()
    server.stop(grace_s=0)
    store.close()


@pytest.fixture(scope="module")
def other_store() -> Iterator[str]:
    """The prefill's node store, in a process of its own; its address."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_serve_store, args=(sender,), daemon=True)
    process.start()
    try:
        assert receiver.poll(START_S), f"the store process did not start ({process.exitcode})"
        yield receiver.recv()
    finally:
        process.terminate()
        process.join(START_S)
        if process.is_alive():
            process.kill()
            process.join(START_S)


@pytest.fixture(scope="module")
def one_hop(engine_config, store_server, other_store) -> Iterator[dict[str, Any]]:
    """A prefill worker writing into `other_store`, decode worker b on store_server (the decode
    worker a test kills, `_decode_process`, too)."""
    workers: dict[str, Any] = {
        "prefill": PrefillWorkerActor(engine_config, other_store),
        "b": DecodeWorkerActor(engine_config.replace(replay_window=WINDOW), store_server[1]),
    }
    for name, worker in workers.items():
        worker.worker_id = f"{name}-one-hop"  # one process: the default ids (host, pid) would be equal
        worker.start("127.0.0.1", 0)
    yield workers
    for worker in workers.values():
        worker.shutdown()


def _store(store_server) -> StateStoreClient:
    return StateStoreClient(store_server[1], timeout_s=10)


def _lose_after(
    workers, rid: str, params: SamplingParams, num_sent: int, source: str = ""
) -> tuple[list[int], decode_pb2.ResumeFrom]:
    """Decode `rid` on worker a (in this process) until `num_sent` tokens came, then lose a as a
    dead process would (its stream cut, nothing it keeps released); (tokens sent, where a kept
    the state). With `source`, the prefill's state is reserved in that store (one hop)."""
    a = workers["a"]

    def cut(stream: Any, where: decode_pb2.ResumeFrom) -> None:
        assert a.replay_publisher is not None and a.replay_publisher.wait_idle(30)
        LOST.add(rid)
        stream.cancel()

    return _decode_until(workers["prefill"].address, a.address, rid, params, num_sent, cut, source)


def _decode_until(
    prefill: str,
    decode: str,
    rid: str,
    params: SamplingParams,
    num_sent: int,
    lose: Callable[[Any, decode_pb2.ResumeFrom], None],
    source: str = "",
) -> tuple[list[int], decode_pb2.ResumeFrom]:
    """Reserve on `decode`, prefill on `prefill`, read the stream until `num_sent` tokens came,
    then `lose(stream, where the decode worker keeps the state)`; (tokens sent, that place)."""
    sp = sampling_params_to_proto(params)
    with make_channel(prefill) as pc, make_channel(decode) as dc:
        stub = decode_pb2_grpc.DecodeStub(dc)
        reserved = stub.Reserve(
            decode_pb2.ReserveRequest(
                request_id=rid, num_prompt_tokens=len(PROMPT), timeout_s=30, source_store_address=source
            ),
            timeout=30,
        )
        assert reserved.accepted, reserved.reject_reason
        first = prefill_pb2_grpc.PrefillStub(pc).Prefill(
            prefill_request(rid, PROMPT, sp, reserved), timeout=60
        )
        sent = [first.first_token_id]
        stream = stub.Decode(decode_request(rid, PROMPT, sp, first), timeout=60)
        where = None
        for delta in stream:
            if delta.HasField("resume_from"):
                where = delta.resume_from
            sent += delta.token_ids
            if len(sent) >= num_sent:
                break
        assert where is not None and where.state_key == reserved.state_key, (
            "no resume_from on the first delta"
        )
        lose(stream, where)
    return sent[:num_sent], where


def _serve_decode(config: EngineConfig, store_address: str, stall_at: int, conn: Connection) -> None:
    """A decode worker process (`_decode_process`): sends its address on `conn`, then serves
    until killed. Its engine thread stops for good once a request has `stall_at` tokens (what
    it publishes still reaches the store), so the request is mid-stream when the kill comes."""
    worker = DecodeWorkerActor(config, store_address)
    worker.worker_id = KILLED
    address = worker.start("127.0.0.1", 0)

    def stall(engine: Any) -> None:  # an observer runs on the engine thread after each step
        if any(len(request.output_token_ids) >= stall_at for request in engine.requests.values()):
            threading.Event().wait()

    worker.loop.observe(stall).result(timeout=START_S)
    conn.send(address)
    signal.pause()


@contextmanager
def _decode_process(engine_config, store_address: str) -> Iterator[tuple[str, BaseProcess]]:
    """Decode worker KILLED in a process of its own, publishing every WINDOW tokens to the store at
    `store_address`, its engine held after NUM_BEFORE_LOSS tokens; (its address, the process),
    which is ended here if the test did not kill it."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    config = engine_config.replace(replay_window=WINDOW)
    process = context.Process(
        target=_serve_decode, args=(config, store_address, NUM_BEFORE_LOSS, sender), daemon=True
    )
    process.start()
    try:
        assert receiver.poll(START_S), f"the decode worker process did not start ({process.exitcode})"
        yield receiver.recv(), process
    finally:
        if process.is_alive():
            process.kill()
        process.join(START_S)


def _kill_after(
    workers, decode: tuple[str, BaseProcess], store_address: str, rid: str, params: SamplingParams, source=""
) -> tuple[list[int], decode_pb2.ResumeFrom]:
    """Decode `rid` on the decode worker process `decode` until it holds (NUM_BEFORE_LOSS tokens
    sent) and its second piece is in the store at `store_address`, then SIGKILL it: its stream
    breaks, nothing it keeps is released. (Tokens sent, where it kept the state.)"""
    address, process = decode
    n = len(PROMPT)

    def kill(stream: Any, where: decode_pb2.ResumeFrom) -> None:
        with StateStoreClient(store_address, timeout_s=10) as client:  # its second piece, whole
            _wait_sealed(
                client, [piece_key(where.state_key, n + WINDOW), kda_key(where.state_key, n + WINDOW)]
            )
        os.kill(process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        process.join(START_S)
        assert process.exitcode == -signal.SIGKILL
        with pytest.raises(grpc.RpcError) as broken:
            next(stream)
        assert broken.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

    return _decode_until(workers["prefill"].address, address, rid, params, NUM_BEFORE_LOSS, kill, source)


def _wait_sealed(client: StateStoreClient, keys: list[str]) -> None:
    """Until every one of `keys` is in the store, sealed."""
    deadline_s = time.monotonic() + WAIT_S
    while not all((info := client.lookup(key)) is not None and info.sealed for key in keys):
        assert time.monotonic() < deadline_s, f"{keys} were not all stored within {WAIT_S:g} s"
        time.sleep(0.01)


def _resume_on_b(
    workers, rid: str, params: SamplingParams, sent: list[int], where
) -> list[decode_pb2.TokenDelta]:
    request = decode_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=PROMPT,
        sampling_params=sampling_params_to_proto(params),
        output_token_ids=sent,
        resume_from=where,
    )
    with make_channel(workers["b"].address) as channel:
        return list(decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=60))


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_decode_worker_killed_mid_stream_is_resumed_from_stored_state_exactly(
    workers, store_server, engine_config, offline, kind
):
    rid = f"stored-{kind}"
    with _decode_process(engine_config, store_server[1]) as killed:
        sent, where = _kill_after(workers, killed, store_server[1], rid, PARAMS[kind])
    assert sent == offline[kind][: len(sent)]
    with _store(store_server) as client:  # what b will find: the pieces reach within a window
        found = read_stored_state(client, where.state_key, rid, len(PROMPT), len(sent), 10)
        assert found.num_pieces >= 2
        assert len(PROMPT) + len(sent) - WINDOW <= found.num_tokens < len(PROMPT) + len(sent)
    deltas = _resume_on_b(workers, rid, PARAMS[kind], sent, where)
    assert sent + [t for d in deltas for t in d.token_ids] == offline[kind]
    assert FINISH_FROM_PROTO[deltas[-1].finish_reason] == "length"
    assert deltas[-1].num_generated_tokens == NUM_TOKENS
    assert deltas[0].resume_from.state_key == f"{workers['b'].worker_id}/{rid}"  # b keeps it now
    _assert_store_empty(workers, store_server)  # what the killed worker kept, b released


def test_a_corrupt_piece_is_data_loss(workers, store_server, offline):
    """A copy of a lost request's prompt state under a key of the test's, then a piece that does
    not decode into one (a conv state alone): the resume fails with DATA_LOSS."""
    rid = "stored-corrupt"
    sent, where = _lose_after(workers, rid, PARAMS["greedy"], NUM_BEFORE_LOSS)
    copy = f"test/{rid}"
    with _store(store_server) as client:
        _copy(client, where.state_key, copy)
        span = (len(PROMPT), len(PROMPT) + WINDOW)
        for key in (piece_key(copy, len(PROMPT)), kda_key(copy, len(PROMPT))):  # rows and KDA part
            _put_garbage(client, key, span)
        with pytest.raises(grpc.RpcError) as failed:
            _resume_on_b(
                workers,
                rid,
                PARAMS["greedy"],
                sent,
                decode_pb2.ResumeFrom(store_address=where.store_address, state_key=copy),
            )
        assert failed.value.code() is grpc.StatusCode.DATA_LOSS, failed.value.details()
        client.release(owner="test")
    _end_on_a(workers, rid)
    _assert_store_empty(workers, store_server)


def test_a_released_state_is_not_found(workers, store_server):
    rid = "stored-gone"
    sent, where = _lose_after(workers, rid, PARAMS["greedy"], 3)
    with _store(store_server) as client:
        client.release(where.state_key)
    with pytest.raises(grpc.RpcError) as failed:
        _resume_on_b(workers, rid, PARAMS["greedy"], sent, where)
    assert failed.value.code() is grpc.StatusCode.NOT_FOUND, failed.value.details()
    _end_on_a(workers, rid)
    _assert_store_empty(workers, store_server)


LONG = 48  # tokens of the long request: 11 pieces of 4, records and checkpoints alternating


@pytest.fixture(scope="module")
def offline_long(engine_config) -> dict[str, list[int]]:
    params = [dataclasses.replace(PARAMS[kind], max_tokens=LONG) for kind in ("greedy", "seeded")]
    outputs = LLM(model=engine_config.model, max_model_len=512).generate(
        prompt_token_ids=[PROMPT, PROMPT], sampling_params=params
    )
    return {"greedy": outputs[0].outputs[0].token_ids, "seeded": outputs[1].outputs[0].token_ids}


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_long_decode_keeps_bounded_kda_state_and_resumes_exactly(
    workers, store_server, offline_long, kind, caplog
):
    """Worker a decodes a whole long request and keeps what it held at the end (as if it died
    then): the store holds every piece's MLA rows but the KDA parts of at most two pieces (the
    newest checkpoint and the records after it), no more bytes than two checkpoints; b resumes
    from there exactly."""
    rid = f"stored-long-{kind}"
    params = dataclasses.replace(PARAMS[kind], max_tokens=LONG)
    LOST.add(rid)  # before the stream ends: a keeps everything
    released_before = workers["a"].replay_publisher.stats.num_kda_released
    sent, where = _lose_after(workers, rid, params, LONG)
    assert sent == offline_long[kind]
    n = len(PROMPT)
    with _store(store_server) as client:
        base = client.lookup(where.state_key)
        assert base is not None
        base_kda_bytes = sum(
            c.num_bytes for c in base.chunks if c.kind in (StateKind.KDA_CONV, StateKind.KDA_RECURRENT)
        )
        num_pieces = (LONG - 1) // WINDOW  # the last token is sampled, never computed
        starts = [n + WINDOW * i for i in range(num_pieces)]
        assert all(client.lookup(piece_key(where.state_key, s)) is not None for s in starts)
        assert client.lookup(piece_key(where.state_key, n + WINDOW * num_pieces)) is None
        kda = [info for s in starts if (info := client.lookup(kda_key(where.state_key, s))) is not None]
        assert 1 <= len(kda) <= 2, [info.key for info in kda]
        assert sum(info.num_bytes for info in kda) <= 2 * base_kda_bytes
        # a copy whose newest checkpoint is unreadable (b releases a's keys once it resumed)
        copy = f"test/{rid}"
        for key in [where.state_key] + [piece_key(where.state_key, s) for s in starts]:
            _copy(client, key, copy + key[len(where.state_key) :])
        for info in kda:
            start = int(info.key.split("/")[-2])
            if any(c.kind is StateKind.KDA_RECURRENT and c.token_start == 0 for c in info.chunks):
                # looks like a checkpoint (a recurrent state from token 0) but is none
                _put_garbage(client, kda_key(copy, start), (0, start + WINDOW), StateKind.KDA_RECURRENT)
            else:
                _copy(client, info.key, kda_key(copy, start))
    assert workers["a"].replay_publisher.stats.num_kda_released - released_before >= num_pieces - 2
    kept = sent[: LONG - 3]  # the client got all but 3: b rebuilds from the newest checkpoint
    with _store(store_server) as client:
        found = read_stored_state(client, where.state_key, rid, n, len(kept), 10)
        assert (found.num_tokens, found.num_pieces) == (starts[-1] + WINDOW, num_pieces)
    deltas = _resume_on_b(workers, rid, params, kept, where)
    assert kept + [t for d in deltas for t in d.token_ids] == offline_long[kind]
    # the newest checkpoint unreadable: the reader falls back to the base (the KDA parts before it
    # are gone) and b recomputes every token sent; still exact
    with _store(store_server) as client:
        with caplog.at_level(logging.INFO, logger="decode_worker.stored_resume"):
            fallback = read_stored_state(client, copy, rid, n, len(kept), 10)
        assert "trying an earlier checkpoint" in caplog.text
        assert fallback.num_tokens == n
        resumed_from = decode_pb2.ResumeFrom(store_address=where.store_address, state_key=copy)
        deltas = _resume_on_b(workers, f"{rid}-fallback", params, kept, resumed_from)
        assert kept + [t for d in deltas for t in d.token_ids] == offline_long[kind]
        client.release(owner="test")
    _end_on_a(workers, rid)
    _assert_store_empty(workers, store_server)


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_killed_decode_worker_resumes_from_its_copy_of_the_prefill_stores_state(
    one_hop, other_store, store_server, engine_config, offline, kind
):
    """One hop: the decode worker read the prompt state from the prefill's node store (a store
    process of its own, which a decode worker reads as another node's: over gRPC, not shared
    memory; it frees the state once read), so the decode worker keeps a copy in its own node's
    store. SIGKILLed mid-stream, b resumes from that copy exactly. (The one hop across two
    real nodes, without failover: tests/deploy/test_multinode_real.py.)"""
    rid = f"one-hop-{kind}"
    with _decode_process(engine_config, store_server[1]) as killed:
        sent, where = _kill_after(one_hop, killed, store_server[1], rid, PARAMS[kind], source=other_store)
    assert where.store_address == store_server[1]  # the killed worker's node store, not the prefill's
    with _store(store_server) as client:
        found = read_stored_state(client, where.state_key, rid, len(PROMPT), len(sent), 10)
        assert found.num_pieces >= 2
    deltas = _resume_on_b(one_hop, rid, PARAMS[kind], sent, where)
    assert sent + [t for d in deltas for t in d.token_ids] == offline[kind]
    _assert_store_empty(one_hop, store_server)
    with StateStoreClient(other_store, timeout_s=10) as client:
        stats = client.stats()
    assert stats.num_keys - stats.num_prefix_keys == 0  # the original, released once read


def _copy(client: StateStoreClient, key: str, to: str) -> None:
    """A copy of `key` under `to` (owner "test")."""
    chunks = [
        Chunk(dataclasses.replace(c.meta, key=to), bytes(c.data)) for c in client.get(key, timeout_s=10)
    ]
    client.put(chunks, owner="test", seal=True)


def _put_garbage(
    client: StateStoreClient, key: str, span: tuple[int, int], kind: StateKind = StateKind.KDA_CONV
) -> None:
    """Under `key` (owner "test"), a state that is no replay piece's: one layer's `kind` alone."""
    data = b"\0" * 64
    meta = ChunkMeta(key, 0, kind, "uint8", (64,), *span, checksum.compute(data))
    client.put([Chunk(meta, data)], owner="test", seal=True)


def _end_on_a(workers, rid: str) -> None:
    """What the leases would do in time: the keys worker a kept for `rid` go."""
    LOST.discard(rid)
    workers["a"].replay_publisher.end(rid)


def _assert_store_empty(workers, store_server) -> None:
    """Every key a request held is released once it ended (the lost worker's by the resumer)."""
    for name in ("a", "b"):
        if name not in workers:
            continue
        publisher = workers[name].replay_publisher
        assert publisher is not None and publisher.wait_idle(30)
    store, _ = store_server
    deadline_s = time.monotonic() + 10
    while (left := store.stats().num_keys - store.stats().num_prefix_keys) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    assert left == 0, f"{left} keys left in the store"
