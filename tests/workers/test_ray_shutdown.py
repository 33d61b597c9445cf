"""A worker actor that Ray ends gracefully (its handles dropped) ends its open Decode streams at
once, so its process can exit: Python's exit waits for the gRPC server's handler threads, and a
stream left running kept a replaced worker's process (and its streams) alive."""

from __future__ import annotations

import threading

import grpc
import pytest

from decode_worker.actor import DecodeWorkerActor
from splitserve.engine_config import EngineConfig
from splitserve.rpc import make_channel
from splitserve.sampling_params import SamplingParams
from splitserve.v1 import decode_pb2, decode_pb2_grpc
from splitserve.wire import sampling_params_to_proto

PROMPT = list(range(3, 20))
LONG = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)  # runs far past the shutdown


@pytest.fixture
def decode_worker(model_path, store_server):
    worker = DecodeWorkerActor(
        EngineConfig(model=str(model_path), max_model_len=4096, max_num_batched_tokens=64), store_server[1]
    )
    address = worker.start("127.0.0.1", 0)
    yield worker, address
    worker.shutdown()


def test_ray_shutdown_ends_an_open_decode_stream_and_stops_the_engine(decode_worker):
    worker, address = decode_worker
    with make_channel(address) as channel:
        # no state and no reservation: this worker computes the prompt itself (prefill.fallback)
        request = decode_pb2.DecodeRequest(
            request_id="open-at-exit", prompt_token_ids=PROMPT, sampling_params=sampling_params_to_proto(LONG)
        )
        stream = decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=120)
        received = len(next(stream).token_ids)
        shutting_down = threading.Thread(target=worker.__ray_shutdown__)
        shutting_down.start()
        with pytest.raises(grpc.RpcError) as ended:
            for delta in stream:
                received += len(delta.token_ids)
        shutting_down.join(60)
    assert not shutting_down.is_alive()
    assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), ended.value
    assert received < LONG.max_tokens  # ended by the shutdown, not by finishing
    assert not worker.loop.alive
