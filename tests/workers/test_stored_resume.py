"""Decode failover from stored state, the workers' side over real gRPC: a decode worker with
`replay_window` keeps the request's prompt state and publishes a ReplaySSM piece every window to
its node's store; when it is lost mid-stream (its process gone: nothing released), another decode
worker given `resume_from` rebuilds the state from the store, recomputes fewer than a window of
the tokens sent, and continues with exactly the offline engine's tokens (greedy and seeded). A
corrupt piece answers DATA_LOSS and a released state NOT_FOUND (the gateway then re-prefills);
a request that ends normally leaves nothing in the store."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from decode_worker.actor import DecodeWorkerActor
from decode_worker.stored_resume import read_stored_state
from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM, SamplingParams
from splitserve.engine.replay_codec import kda_key, piece_key
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
LOST: set[str] = set()  # request ids whose worker a is "dead"
NUM_BEFORE_LOSS = 11  # tokens the lost worker sent: 2 pieces (8 tokens) stored, 3 sent after
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


@pytest.fixture(scope="module")
def one_hop(engine_config, store_server) -> Iterator[tuple[dict[str, Any], StateStore, str]]:
    """The prefill on another node: its own store (the other), the decode workers on store_server."""
    other = StateStore.from_config(StoreConfig(memory_bytes=64 << 20))
    server = StateStoreServer(other, "127.0.0.1", 0)
    workers = _start(engine_config, server.address, store_server[1])
    yield workers, other, server.address
    for worker in workers.values():
        worker.shutdown()
    server.stop(grace_s=0)
    other.close()


def _store(store_server) -> StateStoreClient:
    return StateStoreClient(store_server[1], timeout_s=10)


def _lose_after(
    workers, rid: str, params: SamplingParams, num_sent: int, source: str = ""
) -> tuple[list[int], decode_pb2.ResumeFrom]:
    """Decode `rid` on worker a until `num_sent` tokens came, then lose a as a dead process would
    (its stream broken, nothing it keeps released); (tokens sent, where a kept the state). With
    `source`, the prefill's state is reserved in that store (one hop from another node)."""
    a = workers["a"]
    sp = sampling_params_to_proto(params)
    with make_channel(workers["prefill"].address) as pc, make_channel(a.address) as dc:
        decode = decode_pb2_grpc.DecodeStub(dc)
        reserved = decode.Reserve(
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
        stream = decode.Decode(decode_request(rid, PROMPT, sp, first), timeout=60)
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
        assert a.replay_publisher is not None and a.replay_publisher.wait_idle(30)
        LOST.add(rid)
        stream.cancel()
    return sent[:num_sent], where


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
def test_a_lost_decode_resumes_from_stored_state_exactly(workers, store_server, offline, kind):
    rid = f"stored-{kind}"
    sent, where = _lose_after(workers, rid, PARAMS[kind], NUM_BEFORE_LOSS)
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
    _end_on_a(workers, rid)  # pieces a wrote after b looked (it decoded on until the cancel)
    _assert_store_empty(workers, store_server)


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
def test_a_prompt_state_from_another_nodes_store_is_kept_here_for_failover(
    one_hop, store_server, offline, kind
):
    """One hop: the decode read the prompt state from the prefill's node store (which frees it
    once read), so worker a keeps a copy in its own node's store; b resumes from there exactly."""
    workers, other, other_address = one_hop
    rid = f"one-hop-{kind}"
    sent, where = _lose_after(workers, rid, PARAMS[kind], NUM_BEFORE_LOSS, source=other_address)
    assert where.store_address == store_server[1]  # a's node store, not the prefill's
    with _store(store_server) as client:
        found = read_stored_state(client, where.state_key, rid, len(PROMPT), len(sent), 10)
        assert found.num_pieces >= 2
    deltas = _resume_on_b(workers, rid, PARAMS[kind], sent, where)
    assert sent + [t for d in deltas for t in d.token_ids] == offline[kind]
    _end_on_a(workers, rid)
    _assert_store_empty(workers, store_server)
    assert other.stats().num_keys - other.stats().num_prefix_keys == 0  # the original, released


def _copy(client: StateStoreClient, key: str, to: str) -> None:
    """A copy of `key` under `to` (owner "test")."""
    chunks = [Chunk(dataclasses.replace(c.meta, key=to), bytes(c.data)) for c in client.get(key, timeout_s=10)]
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
        publisher = workers[name].replay_publisher
        assert publisher is not None and publisher.wait_idle(30)
    store, _ = store_server
    deadline_s = time.monotonic() + 10
    while (left := store.stats().num_keys - store.stats().num_prefix_keys) and time.monotonic() < deadline_s:
        time.sleep(0.05)
    assert left == 0, f"{left} keys left in the store"
