"""A decode worker's local prefill (a Decode without state, `max_uncached_tokens` > 0) on real
servers: the conversation's next turn is computed from what the worker kept when the last turn
finished, its tokens equal the offline engine's, and a prompt its cache holds too little of is
refused with nothing started."""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest

from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor
from splitserve import LLM
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.rpc import make_channel
from splitserve.sampling_params import SamplingParams
from splitserve.v1 import decode_pb2, decode_pb2_grpc
from splitserve.wire import sampling_params_to_proto
from tests.workers.client import generate

UNIT = 32
LIMIT = 48
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def caching_config(engine_config):
    return dataclasses.replace(engine_config, enable_prefix_caching=True, prefix_unit=UNIT, prefix_salt="")


@pytest.fixture(scope="module")
def workers(caching_config, store_server):
    _, store_address = store_server
    prefill = PrefillWorkerActor(caching_config, store_address)
    decode = DecodeWorkerActor(caching_config, store_address)
    addresses = prefill.start("127.0.0.1", 0), decode.start("127.0.0.1", 0)
    yield addresses
    prefill.shutdown()
    decode.shutdown()


def _decode_whole(address: str, rid: str, prompt: list[int], limit: int) -> tuple[list[int], int]:
    """A Decode without state: every token it streams, and the prompt tokens its cache served."""
    request = decode_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=sampling_params_to_proto(PARAMS),
        max_uncached_tokens=limit,
        prefix_hashes=prefix_hash_chain(prompt, UNIT, b""),
    )
    tokens, cached = [], 0
    with make_channel(address) as channel:
        for delta in decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=60):
            tokens += list(delta.token_ids)
            cached = cached or delta.num_cached_tokens
    return tokens, cached


def test_the_next_turn_is_computed_from_what_the_decode_worker_kept(workers, model_path) -> None:
    prefill_address, decode_address = workers
    rng = random.Random(3)
    first = [rng.randrange(3, 2000) for _ in range(100)]
    reply = generate(prefill_address, decode_address, "turn-1", first, PARAMS).token_ids
    second = first + reply + [rng.randrange(3, 2000) for _ in range(20)]
    tokens, cached = _decode_whole(decode_address, "turn-2", second, LIMIT)
    offline = LLM(model=str(model_path), max_model_len=512)
    expected = [
        o.outputs[0].token_ids
        for o in offline.generate(prompt_token_ids=[first, second], sampling_params=PARAMS)
    ]
    assert [reply, tokens] == expected
    assert cached == len(first) + len(reply) - 1  # all but the reply's last token, never computed


def test_a_prompt_the_worker_holds_too_little_of_is_refused_and_nothing_starts(workers) -> None:
    _, decode_address = workers
    prompt = list(range(500, 600))  # never seen: 100 tokens to compute
    with pytest.raises(grpc.RpcError) as refused:
        _decode_whole(decode_address, "cold", prompt, LIMIT)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "100 of the prompt's 100 tokens" in (refused.value.details() or "")
    # nothing of it runs there: the same id is free, and with room for it the worker computes it
    tokens, cached = _decode_whole(decode_address, "cold", prompt, len(prompt))
    assert len(tokens) == PARAMS.max_tokens and cached == 0
