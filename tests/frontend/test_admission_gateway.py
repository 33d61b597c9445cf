"""Admission through the real gateway: requests past the decode pool's room queue, only past the
queue's cap get 429 (with Retry-After), a request that can never fit gets 400, every refusal
leaves the pool's slots at their baseline, and queued requests do not hold up admitted streams."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from frontend.app import build_app
from frontend.router import LeastLoadRouter
from frontend.server import GatewayServer
from frontend.settings import GatewaySettings
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.frontend.conftest import MODEL
from tests.frontend.fakes import FakePrefill, FakeWorkerServer, Script

NUM_SLOTS = 4
NUM_TOKENS = 6  # per stream: the prefill's first token and five decoded ones
HOLD_AT = 3  # a held stream sends this many decoded tokens, then waits for the gate


class SlotDecode(decode_pb2_grpc.DecodeServicer):
    """A decode worker with `num_slots` real slots: Reserve takes one (or rejects), the stream's
    end or an Abort gives it back, Stats reports what is free. Streams pause at `HOLD_AT` tokens
    until `gate` is set, so a test can keep slots busy while it watches the queue."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.gate = threading.Event()
        self.held: set[str] = set()
        self.num_reserves = 0
        self._lock = threading.Lock()

    @property
    def num_free_slots(self) -> int:
        with self._lock:
            return self.num_slots - len(self.held)

    def _free(self, rid: str) -> bool:
        with self._lock:
            found = rid in self.held
            self.held.discard(rid)
            return found

    def Reserve(self, request, context):  # noqa: N802
        with self._lock:
            self.num_reserves += 1
            if len(self.held) >= self.num_slots:
                return decode_pb2.ReserveResponse(accepted=False, reject_reason="no free state slots")
            self.held.add(request.request_id)
        return decode_pb2.ReserveResponse(
            accepted=True, store_address="127.0.0.1:1", state_key=request.request_id, expiry_unix_s=1e12
        )

    def Decode(self, request, context):  # noqa: N802
        rid = request.request_id
        try:
            for position in range(1, NUM_TOKENS):
                if position == HOLD_AT + 1:
                    self.gate.wait(30)
                delta = decode_pb2.TokenDelta(request_id=rid, token_ids=[10 + position])
                if position == NUM_TOKENS - 1:
                    delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    self._free(rid)  # as the engine does: the slot is free before the last delta leaves
                yield delta
        finally:
            self._free(rid)  # a stream cut short

    def Abort(self, request, context):  # noqa: N802
        return decode_pb2.AbortDecodeResponse(found=self._free(request.request_id))

    def Stats(self, request, context):  # noqa: N802
        free = self.num_free_slots
        return decode_pb2.DecodeStats(
            max_num_seqs=self.num_slots,
            num_free_kv_blocks=100,
            num_total_kv_blocks=100,
            num_free_state_slots=free,
            num_total_state_slots=self.num_slots,
        )


@dataclass
class Cluster:
    url: str
    app: object
    decode: SlotDecode

    def queue_depth(self) -> int:
        return self.app.state.admission_queue.num_queued  # type: ignore[attr-defined]


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Block until `condition()` holds (checked every 5 ms), or fail naming `what`."""
    done = threading.Event()
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        done.wait(0.005)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    prefill, decode = FakePrefill(Script([10, 11, 12])), SlotDecode(NUM_SLOTS)
    servers = [FakeWorkerServer(prefill), FakeWorkerServer(decode)]
    settings = GatewaySettings(
        model_name=MODEL, max_model_len=256, rpc_timeout_s=5.0, max_queued_requests=2, stats_refresh_s=30.0
    )
    app = build_app(settings, None, LeastLoadRouter([servers[0].address], [servers[1].address]))
    gateway = GatewayServer(app, "127.0.0.1", 0)
    gateway.start()
    try:
        queue = app.state.admission_queue
        _wait_for(lambda: queue.capacity_slots == NUM_SLOTS, "the first Decode.Stats")
        yield Cluster(gateway.url, app, decode)
    finally:
        decode.gate.set()
        gateway.stop()
        for server in servers:
            server.stop()


def _body(num_prompts: int = 1, stream: bool = False) -> dict[str, object]:
    prompts = [[1, 2, 3 + i] for i in range(num_prompts)]
    return {"model": MODEL, "prompt": prompts, "max_tokens": NUM_TOKENS, "stream": stream}


def test_a_request_larger_than_the_whole_pool_gets_400_and_reserves_nothing(cluster: Cluster) -> None:
    response = httpx.post(f"{cluster.url}/v1/completions", json=_body(NUM_SLOTS + 1), timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert f"needs {NUM_SLOTS + 1} decode slots" in message and f"holds {NUM_SLOTS}" in message
    assert cluster.decode.num_reserves == 0 and cluster.decode.num_free_slots == NUM_SLOTS
    # the whole pool at once still fits
    cluster.decode.gate.set()
    assert httpx.post(f"{cluster.url}/v1/completions", json=_body(NUM_SLOTS), timeout=30).status_code == 200
    assert cluster.decode.num_free_slots == NUM_SLOTS


def _stream_tokens(url: str, num_prompts: int, first_tokens: threading.Semaphore) -> int:
    """Stream one request; release `first_tokens` once per choice when its HOLD_AT-th decoded token
    arrives. Returns the number of tokens received."""
    seen: dict[int, int] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=_body(num_prompts, stream=True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                seen[choice["index"]] = seen.get(choice["index"], 0) + 1
                if seen[choice["index"]] == 1 + HOLD_AT:
                    first_tokens.release()
    return sum(seen.values())


def test_past_the_pool_requests_queue_past_the_cap_429_and_admitted_streams_run_on(cluster: Cluster) -> None:
    url = cluster.url
    reached_hold = threading.Semaphore(0)
    with ThreadPoolExecutor(8) as pool:
        # The pool's four slots, held by two streams of two prompts each, mid-stream.
        running = [pool.submit(_stream_tokens, url, 2, reached_hold) for _ in range(2)]
        for _ in range(NUM_SLOTS):
            assert reached_hold.acquire(timeout=30), "the admitted streams never got going"
        # Two more requests wait in the queue (its cap); they reserve nothing while they wait.
        queued: list[Future[httpx.Response]] = [
            pool.submit(httpx.post, f"{url}/v1/completions", json=_body(), timeout=60) for _ in range(2)
        ]
        _wait_for(lambda: cluster.queue_depth() == 2, "two queued requests")
        assert cluster.decode.num_reserves == NUM_SLOTS
        # A third gets 429 with Retry-After at once, and holds nothing.
        refused = httpx.post(f"{url}/v1/completions", json=_body(), timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "max_queued_requests = 2" in refused.json()["error"]["message"]
        assert cluster.decode.num_reserves == NUM_SLOTS and cluster.queue_depth() == 2
        # The admitted streams finish every token while the queue is still full.
        cluster.decode.gate.set()
        assert [f.result(timeout=60) for f in running] == [2 * NUM_TOKENS, 2 * NUM_TOKENS]
        # ...and the queued ones then run to their end.
        for response in (f.result(timeout=60) for f in queued):
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == NUM_TOKENS
    assert cluster.decode.num_free_slots == NUM_SLOTS
    assert cluster.app.state.admission_queue.num_slots_in_use == 0  # type: ignore[attr-defined]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'splitserve_admission_refusals_total{model_name="tiny-kimi",reason="queue_full"} 1.0' in metrics


def test_a_client_that_leaves_the_queue_frees_its_place(cluster: Cluster) -> None:
    reached_hold = threading.Semaphore(0)
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(_stream_tokens, cluster.url, NUM_SLOTS, reached_hold)
        for _ in range(NUM_SLOTS):
            assert reached_hold.acquire(timeout=30)
        payload = json.dumps(_body()).encode()
        host, port = cluster.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as leaving:
            leaving.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            _wait_for(lambda: cluster.queue_depth() == 1, "the queued request")
        # the connection dropped: the gateway sees the disconnect and takes it out of the queue
        _wait_for(lambda: cluster.queue_depth() == 0, "the queue to drop the departed client")
        cluster.decode.gate.set()
        assert running.result(timeout=60) == NUM_SLOTS * NUM_TOKENS
    assert cluster.decode.num_free_slots == NUM_SLOTS and cluster.decode.num_reserves == NUM_SLOTS


def test_a_refusal_after_some_prompts_reserved_frees_their_slots_before_it_answers(cluster: Cluster) -> None:
    # Two slots taken behind the gateway's back: its ledger admits four prompts, the worker takes two.
    cluster.decode.held.update({"elsewhere-0", "elsewhere-1"})
    baseline = cluster.decode.num_free_slots
    response = httpx.post(f"{cluster.url}/v1/completions", json=_body(NUM_SLOTS), timeout=30)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert cluster.decode.num_free_slots == baseline  # right after the answer, not once they lapse
    assert cluster.app.state.admission_queue.num_slots_in_use == 0  # type: ignore[attr-defined]


class SlowReserveDecode(SlotDecode):
    """Holds the Reserve of prompt 0 until `reserve_gate` is set; rejects prompt 1's once prompt 0's
    has arrived, so the gateway gives up on the request while prompt 0's Reserve is in flight."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.reserve_gate = threading.Event()
        self.first_arrived = threading.Event()
        self.rejected = threading.Event()

    def Reserve(self, request, context):  # noqa: N802
        if request.request_id.endswith("-0"):
            self.first_arrived.set()
            self.reserve_gate.wait(30)
            return super().Reserve(request, context)  # granted, after the gateway gave up
        self.first_arrived.wait(30)
        self.rejected.set()
        return decode_pb2.ReserveResponse(accepted=False, reject_reason="no free KV blocks")


def test_a_reserve_in_flight_when_the_request_fails_is_aborted_not_left_to_lapse() -> None:
    prefill, decode = FakePrefill(Script([10, 11, 12])), SlowReserveDecode(NUM_SLOTS)
    servers = [FakeWorkerServer(prefill), FakeWorkerServer(decode)]
    settings = GatewaySettings(model_name=MODEL, max_model_len=256, rpc_timeout_s=30.0)
    gateway = GatewayServer(
        build_app(settings, None, LeastLoadRouter([servers[0].address], [servers[1].address]))
    )
    gateway.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(httpx.post, f"{gateway.url}/v1/completions", json=_body(2), timeout=60)
            assert decode.rejected.wait(30), "prompt 1's Reserve never came"
            decode.reserve_gate.set()  # prompt 0's room is granted only now
            response = sent.result(timeout=60)
        assert response.status_code == 429
        assert decode.num_free_slots == NUM_SLOTS  # aborted before the 429, not held until it lapses
    finally:
        decode.reserve_gate.set()
        gateway.stop()
        for server in servers:
            server.stop()
