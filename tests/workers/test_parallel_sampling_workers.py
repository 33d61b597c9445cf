"""`n` samples through real workers: one Reserve for all of them, one Prefill drawing every
sample's first token and writing the prompt's state once, one Decode forking it, streamed with
sample indexes; tokens equal the offline engine's separate requests seeded seed + i."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.rpc import make_channel
from splitserve.state.client import StateStoreClient
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from splitserve.wire import decode_request, prefill_request, sampling_params_to_proto

PROMPT = list(range(3, 140))
PARAMS = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=70, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(engine_config) -> list[list[int]]:
    """Each sample as a separate request, seeded 70, 71, 72."""
    llm = LLM(model=engine_config.model, max_model_len=512)
    alone = [PARAMS.replace(n=1, seed=PARAMS.seed + i) for i in range(PARAMS.n)]
    return [
        o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[PROMPT] * 3, sampling_params=alone)
    ]


def _run(
    prefill: str, decode: str, rid: str, ended: set[int] = frozenset()
) -> tuple[dict[int, list[int]], int]:
    """Reserve → Prefill → Decode for PARAMS' samples (the ones in `ended` marked finished as the
    gateway does after a stop string); each sample's tokens, and the state bytes the prefill wrote."""
    sp = sampling_params_to_proto(PARAMS)
    with make_channel(prefill) as pc, make_channel(decode) as dc:
        decode_stub = decode_pb2_grpc.DecodeStub(dc)
        reserved = decode_stub.Reserve(
            decode_pb2.ReserveRequest(
                request_id=rid, num_prompt_tokens=len(PROMPT), timeout_s=30, num_samples=PARAMS.n
            ),
            timeout=30,
        )
        assert reserved.accepted, reserved.reject_reason
        first = prefill_pb2_grpc.PrefillStub(pc).Prefill(
            prefill_request(rid, PROMPT, sp, reserved), timeout=60
        )
        assert len(first.samples) == PARAMS.n and first.first_token_id == first.samples[0].token_id
        tokens = {i: [s.token_id] for i, s in enumerate(first.samples)}
        request = decode_request(rid, PROMPT, sp, first)
        request.samples.extend(first.samples)
        for i in ended:
            request.samples[i].finish_reason = common_pb2.FINISH_REASON_STOP
        finished: set[int] = set()
        for delta in decode_stub.Decode(request, timeout=60):
            assert delta.sample_index not in finished and delta.sample_index not in ended
            tokens[delta.sample_index] += list(delta.token_ids)
            assert delta.num_generated_tokens == len(tokens[delta.sample_index])
            if delta.finish_reason:
                finished.add(delta.sample_index)
        assert finished == set(range(PARAMS.n)) - ended
    return tokens, first.timing.state_bytes


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_samples_from_one_prefill_equal_separate_seeded_requests(cluster, store_server, offline, mode):
    workers, addr = cluster
    prefill, decode = (
        (addr["prefill"], addr["decode"]) if mode == "disaggregated" else (addr["colocated"],) * 2
    )
    tokens, state_bytes = _run(prefill, decode, f"n-{mode}")
    assert [tokens[i] for i in range(PARAMS.n)] == offline
    if mode == "disaggregated":  # the prompt's state, written once for the three samples
        plan = workers["prefill"].loop.engine.plan
        assert state_bytes == len(PROMPT) * plan.block_bytes // plan.mla.block_size + plan.slot_bytes
    for name in ("prefill", "decode", "colocated"):
        stats = workers[name].stats()
        assert stats["num_running"] == stats["num_reserved"] == 0
        assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]
        assert stats["num_free_state_slots"] == stats["num_total_state_slots"]
    with StateStoreClient(store_server[1]) as store:
        assert store.stats().num_keys == 0


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_sample_the_gateway_ended_is_not_decoded(cluster, offline, mode):
    _, addr = cluster
    prefill, decode = (
        (addr["prefill"], addr["decode"]) if mode == "disaggregated" else (addr["colocated"],) * 2
    )
    tokens, _ = _run(prefill, decode, f"ended-{mode}", ended={1})
    assert tokens[0] == offline[0] and tokens[2] == offline[2] and len(tokens[1]) == 1


def test_a_decode_without_state_draws_every_sample_itself(cluster, offline):
    _, addr = cluster
    request = decode_pb2.DecodeRequest(
        request_id="n-local", prompt_token_ids=PROMPT, sampling_params=sampling_params_to_proto(PARAMS)
    )
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with make_channel(addr["decode"]) as dc:
        for delta in decode_pb2_grpc.DecodeStub(dc).Decode(request, timeout=60):
            tokens[delta.sample_index] += list(delta.token_ids)
    assert [tokens[i] for i in range(3)] == offline
