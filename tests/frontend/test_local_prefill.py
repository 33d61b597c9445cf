"""Conditional disaggregation (`router.local_prefill_max_tokens`) against fake workers on real gRPC:
a prompt the decode worker holds all but a few tokens of is prefilled there, with no prefill
worker and no handoff; a worker that holds less refuses and the prompt goes the usual way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from frontend.app import build_app
from frontend.prefix_router import PrefixAwareRouter
from frontend.server import GatewayServer
from frontend.settings import GatewaySettings
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.v1 import decode_pb2
from tests.frontend.conftest import MODEL
from tests.frontend.fakes import FakeDecode, FakeWorkerServer, Script
from tests.frontend.test_prefix_gateway import CachingPrefill, wait_for

UNIT = 16
LIMIT = 2 * UNIT  # uncached tokens a decode worker may prefill itself
MAX_TOKENS = 3
FIRST_TURN = list(range(300, 300 + 4 * UNIT)) + [7, 8, 9]  # longer than LIMIT: a prefill worker's


@dataclass
class CachingDecode(FakeDecode):
    """A fake decode worker whose prefix cache holds the first `num_cached_tokens` of any prompt.
    A Decode without state streams every token, the first with the cached count; one leaving
    more of its prompt uncached than `max_uncached_tokens` is refused as the real worker refuses."""

    num_cached_tokens: int = 0

    def Decode(self, request, context):  # noqa: N802
        if request.HasField("state"):
            yield from super().Decode(request, context)
            return
        uncached = len(request.prompt_token_ids) - self.num_cached_tokens
        if request.max_uncached_tokens and uncached > request.max_uncached_tokens:
            self.decodes.append(request)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{uncached} tokens are not cached here")
        yield decode_pb2.TokenDelta(
            request_id=request.request_id,
            token_ids=[self.script.token_ids[0]],
            num_generated_tokens=1,
            num_cached_tokens=self.num_cached_tokens,
        )
        yield from super().Decode(request, context)  # from the second token on, as after a prefill


@dataclass
class Deployment:
    url: str
    router: PrefixAwareRouter
    prefill: CachingPrefill
    decode: CachingDecode

    def complete(self, prompt: list[int]) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def local_prefills(self, outcome: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        series = f'splitserve_local_prefills_total{{model_name="{MODEL}",outcome="{outcome}"}}'
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(series)]
        return values[0] if values else 0.0

    def stateless_decodes(self) -> list[decode_pb2.DecodeRequest]:
        return [r for r in self.decode.decodes if not r.HasField("state")]


@contextlib.contextmanager
def deployment(script: Script, **settings: object) -> Iterator[Deployment]:
    prefill, decode = CachingPrefill(script), CachingDecode(script)
    servers = [FakeWorkerServer(prefill), FakeWorkerServer(decode)]
    gateway: GatewayServer | None = None
    try:
        router = PrefixAwareRouter([servers[0].address], [servers[1].address], prefix_unit=UNIT)
        config = GatewaySettings(
            **{"model_name": MODEL, "max_model_len": 512, "prefix_unit": UNIT,
               "local_prefill_max_tokens": LIMIT, **settings}
        )  # fmt: skip
        gateway = GatewayServer(build_app(config, None, router), "127.0.0.1", 0)
        gateway.start()
        yield Deployment(gateway.url, router, prefill, decode)
    finally:
        if gateway is not None:
            gateway.stop()
        for server in servers:
            server.stop()


def _next_turn(script: Script) -> list[int]:
    """The first turn, its reply (the script's first tokens) and two new tokens."""
    return FIRST_TURN + script.token_ids[:MAX_TOKENS] + [11, 12]


def test_the_next_turn_is_prefilled_on_the_decode_worker_holding_the_conversation(script: Script) -> None:
    with deployment(script) as d:
        first = d.complete(FIRST_TURN)
        assert len(d.prefill.requests) == 1 and d.stateless_decodes() == []  # too long to be local
        # what the decode worker keeps of the first turn: prompt and reply but the last token
        d.decode.num_cached_tokens = len(FIRST_TURN) + MAX_TOKENS - 1
        turn = _next_turn(script)
        second = d.complete(turn)
        assert len(d.prefill.requests) == 1, "the second turn went to the prefill worker"
        [local] = d.stateless_decodes()
        assert local.max_uncached_tokens == LIMIT
        assert list(local.prefix_hashes) == prefix_hash_chain(turn, UNIT, MODEL.encode())
        assert second["choices"][0]["text"] == first["choices"][0]["text"]  # the same script
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == d.decode.num_cached_tokens
        assert d.local_prefills("served") == 1


def test_a_decode_worker_holding_less_refuses_and_the_prefill_worker_computes_it(script: Script) -> None:
    with deployment(script) as d:
        first = d.complete(FIRST_TURN)
        turn = _next_turn(script)  # the gateway believes the decode holds 69 tokens of it; it holds none
        second = d.complete(turn)
        assert len(d.stateless_decodes()) == 1  # offered, refused
        assert len(d.prefill.requests) == 2
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert d.local_prefills("refused") == 1 and d.local_prefills("served") == 0
        # the router now knows what the worker keeps: the end of the turn it just finished
        address = d.router.decode_addresses[0]
        kept = len(turn) + MAX_TOKENS - 1
        assert d.router.decode_prefix_match(prefix_hash_chain(turn, UNIT, MODEL.encode())) == {address: kept}


def test_with_the_limit_at_zero_every_prompt_goes_to_a_prefill_worker(script: Script) -> None:
    with deployment(script, local_prefill_max_tokens=0) as d:
        d.decode.num_cached_tokens = len(FIRST_TURN) + MAX_TOKENS - 1
        d.complete(FIRST_TURN)
        d.complete(_next_turn(script))
        d.complete([5, 6, 7])
        assert len(d.prefill.requests) == 3
        assert d.stateless_decodes() == []


@pytest.mark.parametrize("caching", [True, False])
def test_a_prompt_no_longer_than_the_limit_is_prefilled_on_a_decode_worker(
    script: Script, caching: bool
) -> None:
    with deployment(script, enable_prefix_caching=caching) as d:
        d.complete(list(range(40, 40 + LIMIT)))
        assert d.prefill.requests == []
        [local] = d.stateless_decodes()
        assert len(local.prefix_hashes) == (2 if caching else 0)


def test_a_decode_worker_believed_full_is_not_offered_a_local_prefill(script: Script) -> None:
    with deployment(script, stats_refresh_s=0.05) as d:
        d.decode.stats = decode_pb2.DecodeStats(
            max_num_seqs=8, num_free_kv_blocks=100, num_total_kv_blocks=100,
            num_free_state_slots=0, num_total_state_slots=8,
        )  # fmt: skip
        address = d.router.decode_addresses[0]
        assert wait_for(lambda: not d.router.decode_has_room(address))  # Stats are read every 50 ms
        d.complete([5, 6, 7])
        assert d.stateless_decodes() == []
        assert len(d.prefill.requests) == 1
