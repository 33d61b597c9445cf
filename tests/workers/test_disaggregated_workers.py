"""Prefill and decode workers over real gRPC and a real store give the offline engine's tokens."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM, SamplingParams
from splitserve.rpc import make_channel
from splitserve.state.client import StateStoreClient
from splitserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from splitserve.wire import decode_request, prefill_request, sampling_params_to_proto
from tests.workers.client import generate

PROMPTS = [[5, 6, 7], list(range(3, 140)), [40] * 20 + list(range(60, 100)), list(range(200, 210))]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=10, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(engine_config):
    llm = LLM(model=engine_config.model, max_model_len=512)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[_params(i) for i in range(len(PROMPTS))])
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_concurrent_requests_match_the_offline_engine(cluster, offline, mode):
    _, addr = cluster
    prefill, decode = (
        (addr["prefill"], addr["decode"]) if mode == "disaggregated" else (addr["colocated"],) * 2
    )
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [
            pool.submit(generate, prefill, decode, f"{mode}-{i}", p, _params(i))
            for i, p in enumerate(PROMPTS)
        ]
        results = [f.result(timeout=120) for f in futures]
    assert [r.token_ids for r in results] == offline
    assert all(r.finish_reason == "length" for r in results)


def test_every_resource_is_freed_after_the_requests(cluster, store_server, offline):
    workers, addr = cluster
    generate(addr["prefill"], addr["decode"], "free-check", PROMPTS[1], _params(0))
    for name in ("prefill", "decode"):
        stats = workers[name].stats()
        assert stats["num_running"] == stats["num_reserved"] == stats["num_waiting"] == 0
        assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]
        assert stats["num_free_state_slots"] == stats["num_total_state_slots"]
    with StateStoreClient(store_server[1]) as store:
        store_stats = store.stats()
    assert store_stats.num_keys == 0
    assert all(t.num_bytes == 0 for t in store_stats.tiers)


def test_the_prefill_reports_every_state_byte_it_streamed(cluster):
    workers, addr = cluster
    plan = workers["prefill"].loop.engine.plan
    mla_bytes_per_token = plan.block_bytes // plan.mla.block_size  # every MLA layer's latent row
    for i, prompt in enumerate(PROMPTS[:2]):
        timing = generate(addr["prefill"], addr["decode"], f"bytes-{i}", prompt, _params(0)).timing
        assert timing is not None
        assert timing.state_bytes == len(prompt) * mla_bytes_per_token + plan.slot_bytes
        assert timing.state_stream_s >= timing.state_put_s > 0


def test_decode_without_reservation_is_not_found(cluster):
    _, addr = cluster
    # with a state handle (a Decode without one is prefill.fallback's decode_local: it prefills itself)
    ghost = decode_pb2.DecodeRequest(request_id="ghost", state=common_pb2.StateHandle(key="ghost"))
    with make_channel(addr["decode"]) as ch, pytest.raises(grpc.RpcError) as err:
        list(decode_pb2_grpc.DecodeStub(ch).Decode(ghost, timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "call Reserve first" in err.value.details()


def test_corrupted_state_fails_the_request_clearly_and_frees_it(cluster, store_server, monkeypatch):
    """Fault injection: the store's tier hands back one flipped byte for this request's state."""
    store, _ = store_server
    workers, addr = cluster
    fetch = store._tiers.fetch

    def corrupting_fetch(cid):
        data = fetch(cid)
        if data and "corrupt-me" in repr(cid):
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    monkeypatch.setattr(store._tiers, "fetch", corrupting_fetch)
    # the damage is injected where bytes leave the store's tiers: keep the state off the shared-
    # memory arena (whose regions the readers map directly; the store's own tests corrupt those)
    monkeypatch.setattr(StateStoreClient, "local_arena", lambda self: None)
    with pytest.raises(grpc.RpcError) as err:
        generate(addr["prefill"], addr["decode"], "corrupt-me", PROMPTS[1], _params(0))
    # whichever side meets the damage first (the decode's read, or the prefill's next write into
    # the key the store dropped) ends the request with DATA_LOSS and says why
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert "corrupt" in err.value.details() or "damaged" in err.value.details()
    stats = workers["decode"].stats()
    assert stats["num_running"] == stats["num_reserved"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]
    assert stats["num_free_state_slots"] == stats["num_total_state_slots"]


def _wait_until(condition, timeout_s: float = 30.0) -> bool:
    """Poll an observable condition until it holds or the deadline passes (no fixed sleeps)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_client_that_disconnects_mid_stream_frees_everything(cluster, store_server, mode):
    from splitserve.v1 import prefill_pb2_grpc
    from splitserve.wire import sampling_params_to_proto

    workers, addr = cluster
    prefill_addr, decode_addr = (
        (addr["prefill"], addr["decode"]) if mode == "disaggregated" else (addr["colocated"],) * 2
    )
    decoder = workers["decode" if mode == "disaggregated" else "colocated"]
    params = sampling_params_to_proto(SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    prompt = PROMPTS[2]
    with make_channel(prefill_addr) as pc, make_channel(decode_addr) as dc:
        decode = decode_pb2_grpc.DecodeStub(dc)
        reserved = decode.Reserve(
            decode_pb2.ReserveRequest(request_id=f"gone-{mode}", num_prompt_tokens=len(prompt))
        )
        first = prefill_pb2_grpc.PrefillStub(pc).Prefill(
            prefill_request(f"gone-{mode}", prompt, params, reserved), timeout=60
        )
        stream = decode.Decode(decode_request(f"gone-{mode}", prompt, params, first))
        next(stream)
        assert decoder.stats()["num_running"] == 1
        stream.cancel()  # the client goes away

    def freed() -> bool:
        s = decoder.stats()
        return (
            s["num_running"] == s["num_reserved"] == 0 and s["num_free_kv_blocks"] == s["num_total_kv_blocks"]
        )

    assert _wait_until(freed), decoder.stats()
    assert store_server[0].stats().num_keys == 0


def test_a_one_token_prefill_needs_no_state_target_and_writes_nothing(cluster, store_server, engine_config):
    workers, addr = cluster
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    request = prefill_pb2.PrefillRequest(
        request_id="one-token", prompt_token_ids=PROMPTS[1], sampling_params=sampling_params_to_proto(params)
    )
    with make_channel(addr["prefill"]) as ch:
        response = prefill_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=60)
    offline = LLM(model=engine_config.model, max_model_len=512).generate(
        prompt_token_ids=[PROMPTS[1]], sampling_params=params
    )
    assert [response.first_token_id] == offline[0].outputs[0].token_ids
    assert response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert not response.HasField("state") and response.timing.state_bytes == 0
    stats = workers["prefill"].stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]


def test_a_prefill_that_hands_off_must_name_its_state_target(cluster):
    _, addr = cluster
    params = SamplingParams(temperature=0, max_tokens=4)
    request = prefill_pb2.PrefillRequest(
        request_id="no-target", prompt_token_ids=PROMPTS[0], sampling_params=sampling_params_to_proto(params)
    )
    with make_channel(addr["prefill"]) as ch, pytest.raises(grpc.RpcError) as err:
        prefill_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unless max_tokens is 1" in err.value.details()


def _closed_port_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_prefill_whose_store_is_down_fails_unavailable_so_the_gateway_retries(engine_config):
    """Its node's store, which it must write into, cannot be reached (SIGKILLed, restarting): the
    Prefill ends UNAVAILABLE naming the store (the gateway then runs the prompt elsewhere), not
    UNKNOWN (an exception escaping the servicer, which the gateway takes for a bug and does not
    retry: opening a write into this node's store maps its arena first, and that call raised)."""
    dead = _closed_port_address()
    worker = PrefillWorkerActor(engine_config, dead)  # its node's store is the dead one
    address = worker.start("127.0.0.1", 0)
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        request = prefill_pb2.PrefillRequest(
            request_id="store-down",
            prompt_token_ids=PROMPTS[0],
            sampling_params=sampling_params_to_proto(params),
            store_address=dead,
            state_key="store-down/key",
        )
        with make_channel(address) as ch, pytest.raises(grpc.RpcError) as err:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert f"writing state to {dead} failed" in err.value.details()
        stats = worker.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
    finally:
        worker.shutdown()
