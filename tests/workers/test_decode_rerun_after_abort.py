"""A request id the gateway runs again on the same decode worker after its reservation failed.

When a prefill's store fails a write, the gateway aborts the reservation and runs the prompt
again, often on the same decode worker under the same request id (`prefill.fallback:
decode_local`). The aborted reservation's reader ends on its own thread, maybe only after the
new Decode started; its failure callback must not abort the new request by id: an aborted
request sends no further update, so its stream would wait for ever (seen as a client's
ReadTimeout in tests/faults/test_transfer_faults.py under load)."""

from __future__ import annotations

import time

from splitserve.rpc import make_channel
from splitserve.sampling_params import SamplingParams
from splitserve.v1 import decode_pb2, decode_pb2_grpc
from splitserve.wire import FINISH_FROM_PROTO, sampling_params_to_proto
from tests.workers.client import reserve

PROMPT = list(range(5, 41))
NUM_TOKENS = 48
DEADLINE_S = 120  # a hang guard: the stream ends long before, or the request was lost


def test_a_late_failure_of_an_aborted_reservation_leaves_the_rerun_request_alone(cluster):
    workers, addr = cluster
    servicer = workers["decode"].servicer
    rid = "rerun-after-abort"
    reserve(addr["decode"], rid, PROMPT)
    reader = servicer._readers[rid]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with make_channel(addr["decode"]) as channel:
        decode = decode_pb2_grpc.DecodeStub(channel)
        decode.Abort(decode_pb2.AbortDecodeRequest(request_id=rid), timeout=30)
        stream = decode.Decode(
            decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=PROMPT, sampling_params=sampling_params_to_proto(params)
            ),
            timeout=DEADLINE_S,
        )
        deltas = iter(stream)
        first = next(deltas)  # the rerun is in the engine now
        # what the aborted reader's thread does when it ends after this point
        reader._on_failure(reader)
        token_ids = list(first.token_ids)
        finish = None
        for delta in deltas:
            token_ids += list(delta.token_ids)
            finish = FINISH_FROM_PROTO[delta.finish_reason]
    assert (len(token_ids), finish) == (NUM_TOKENS, "length")
    stats = workers["decode"].stats()
    assert stats["num_reserved"] == 0


def test_a_reservation_whose_read_fails_while_pending_still_frees_its_room(cluster):
    workers, addr = cluster
    rid = "fails-while-pending"
    reserve(addr["decode"], rid, PROMPT)
    assert workers["decode"].stats()["num_reserved"] == 1
    workers["decode"].servicer._readers[rid].cancel()  # its read ends with an error, nothing took it
    deadline = time.monotonic() + 30  # a hang guard, not a latency bound
    while workers["decode"].stats()["num_reserved"]:
        assert time.monotonic() < deadline, "the failed reservation's room was not freed"
        time.sleep(0.01)
    with make_channel(addr["decode"]) as channel:  # the gateway's Abort after the failure: a no-op
        decode_pb2_grpc.DecodeStub(channel).Abort(decode_pb2.AbortDecodeRequest(request_id=rid), timeout=30)
    assert workers["decode"].stats()["num_reserved"] == 0
