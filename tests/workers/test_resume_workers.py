"""Decode failover's worker side over real gRPC: a request resumed from prompt + the tokens already
sent (`output_token_ids`) continues with exactly the offline engine's tokens, whether a prefill
worker re-prefills it for a decode worker, a colocated worker takes it, or a decode worker
computes it alone (no prefill worker: `prefill.fallback: decode_local`)."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.rpc import make_channel
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from splitserve.wire import FINISH_FROM_PROTO, decode_request, prefill_request, sampling_params_to_proto

PROMPT = list(range(7, 90))
NUM_TOKENS = 12
NUM_SENT = 5  # tokens the lost worker had sent
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=21, max_tokens=NUM_TOKENS, ignore_eos=True),
}


@pytest.fixture(scope="module")
def offline(engine_config) -> dict[str, list[int]]:
    llm = LLM(model=engine_config.model, max_model_len=512)
    return {
        name: llm.generate(prompt_token_ids=[PROMPT], sampling_params=p)[0].outputs[0].token_ids
        for name, p in PARAMS.items()
    }


def _resume(prefill_address: str, decode_address: str, rid: str, params: SamplingParams, sent: list[int]):
    """What the gateway does on failover: reserve room for prompt + sent, re-prefill, decode."""
    sp = sampling_params_to_proto(params)
    with make_channel(prefill_address) as pc, make_channel(decode_address) as dc:
        decode = decode_pb2_grpc.DecodeStub(dc)
        reserve = decode_pb2.ReserveRequest(
            request_id=rid, num_prompt_tokens=len(PROMPT) + len(sent), timeout_s=30
        )
        reserved = decode.Reserve(reserve, timeout=30)
        assert reserved.accepted, reserved.reject_reason
        request = prefill_request(rid, PROMPT, sp, reserved)
        request.output_token_ids.extend(sent)
        first = prefill_pb2_grpc.PrefillStub(pc).Prefill(request, timeout=60)
        tokens = [first.first_token_id]
        resumed = decode_request(rid, PROMPT, sp, first)
        resumed.output_token_ids.extend(sent)
        deltas = list(decode.Decode(resumed, timeout=60))
    tokens += [t for d in deltas for t in d.token_ids]
    assert FINISH_FROM_PROTO[deltas[-1].finish_reason] == "length"
    assert deltas[-1].num_generated_tokens == NUM_TOKENS
    return tokens


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_reprefill_for_a_decode_worker_continues_exactly(cluster, offline, kind):
    _, addresses = cluster
    expected = offline[kind]
    sent = expected[:NUM_SENT]
    tokens = _resume(addresses["prefill"], addresses["decode"], f"resume-{kind}", PARAMS[kind], sent)
    assert sent + tokens == expected


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_colocated_worker_resumes_exactly(cluster, offline, kind):
    _, addresses = cluster
    expected = offline[kind]
    sent = expected[:NUM_SENT]
    colocated = addresses["colocated"]
    tokens = _resume(colocated, colocated, f"resume-colocated-{kind}", PARAMS[kind], sent)
    assert sent + tokens == expected


def test_a_decode_worker_alone_resumes_exactly(cluster, offline):
    """No prefill worker: a Decode without state computes prompt + sent itself and streams the rest."""
    _, addresses = cluster
    expected = offline["seeded"]
    sent = expected[:NUM_SENT]
    request = decode_pb2.DecodeRequest(
        request_id="resume-local",
        prompt_token_ids=PROMPT,
        sampling_params=sampling_params_to_proto(PARAMS["seeded"]),
        output_token_ids=sent,
    )
    with make_channel(addresses["decode"]) as dc:
        deltas = list(decode_pb2_grpc.DecodeStub(dc).Decode(request, timeout=60))
    assert sent + [t for d in deltas for t in d.token_ids] == expected
    assert deltas[-1].num_generated_tokens == NUM_TOKENS
