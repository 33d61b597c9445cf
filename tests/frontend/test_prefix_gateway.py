"""The gateway's side of prefix caching, against fake workers: the chain it sends, the cached
tokens it reports, the cache reports it polls, and where prompts sharing a prefix go."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from frontend.app import build_app
from frontend.prefix_router import PrefixAwareRouter
from frontend.router import LeastLoadRouter, Router
from frontend.server import GatewayServer
from frontend.settings import GatewaySettings
from splitserve.engine.prefix_cache.events import PrefixEvent
from splitserve.prefix_hash import prefix_hash_chain
from splitserve.v1 import prefill_pb2
from splitserve.worker.cache_report import CacheReporter
from tests.frontend.conftest import MODEL
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeWorkerServer, Script
from tests.prefix.queued_events import QueuedPrefixEvents

UNIT = 16
SHARED = list(range(300, 300 + 4 * UNIT))  # a 4-unit shared prefix of token ids


@dataclass
class CachingPrefill(FakePrefill):
    """A fake prefill that reports `num_cached_tokens` and hands out queued cache events."""

    num_cached_tokens: int = 0
    events: list[prefill_pb2.PrefixEvent] = field(default_factory=list)
    num_reports: int = 0

    def Prefill(self, request, context):  # noqa: N802
        response = super().Prefill(request, context)
        response.num_cached_tokens = self.num_cached_tokens
        return response

    def CacheReport(self, request, context):  # noqa: N802
        self.num_reports += 1
        events, self.events = self.events, []
        return prefill_pb2.PrefixCacheReport(
            instance_id="engine-1", events=events, num_queried_tokens=1000, num_hit_tokens=600,
            num_imported_tokens=200, num_lost_to_missing_state_tokens=64, num_snapshots=3,
            snapshot_bytes=4096, num_evictions=2,
        )  # fmt: skip


@dataclass
class Cluster:
    url: str
    router: Router
    prefills: list[CachingPrefill]
    addresses: list[str]

    def complete(self, prompt: list[int], **extra: object) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, **extra}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text


@contextlib.contextmanager
def cluster(
    tokenizer_path: Path | None,
    script: Script,
    num_prefill: int = 1,
    policy: str = "prefix_aware",
    **settings: object,
) -> Iterator[Cluster]:
    prefills = [CachingPrefill(script) for _ in range(num_prefill)]
    servers = [FakeWorkerServer(p) for p in prefills]
    servers.append(FakeWorkerServer(FakeDecode(script)))
    gateway: GatewayServer | None = None
    try:
        addresses = [s.address for s in servers[:-1]]
        decode = [servers[-1].address]
        router: Router = (
            PrefixAwareRouter(addresses, decode, prefix_unit=UNIT)
            if policy == "prefix_aware"
            else LeastLoadRouter(addresses, decode)
        )
        config = GatewaySettings(
            **{"model_name": MODEL, "max_model_len": 512, "prefix_unit": UNIT, "stats_refresh_s": 0.05,
               **settings}
        )  # fmt: skip
        gateway = GatewayServer(build_app(config, tokenizer_path, router), "127.0.0.1", 0)
        gateway.start()
        yield Cluster(gateway.url, router, prefills, addresses)
    finally:
        if gateway is not None:
            gateway.stop()
        for server in servers:
            server.stop()


def wait_for(condition, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_prefill_request_carries_the_prompt_chain_salted_with_the_model_name(script: Script) -> None:
    prompt = SHARED + [7, 8, 9]
    with cluster(None, script) as c:
        c.complete(prompt)
        sent = list(c.prefills[0].requests[0].prefix_hashes)
    assert sent == prefix_hash_chain(prompt, UNIT, MODEL.encode())
    assert len(sent) == 4
    assert sent != prefix_hash_chain(prompt, UNIT, b"")


def test_with_caching_off_no_chain_is_sent(script: Script) -> None:
    with cluster(None, script, enable_prefix_caching=False) as c:
        c.complete(SHARED)
        assert list(c.prefills[0].requests[0].prefix_hashes) == []
        assert c.prefills[0].num_reports == 0  # and no cache reports are polled


@pytest.mark.parametrize("stream", [False, True])
def test_completions_usage_reports_cached_tokens(script: Script, stream: bool) -> None:
    with cluster(None, script) as c:
        c.prefills[0].num_cached_tokens = 48
        if not stream:
            usage = c.complete(SHARED)["usage"]
        else:
            body = {"model": MODEL, "prompt": SHARED, "max_tokens": 3, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", f"{c.url}/v1/completions", json=body, timeout=30) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            usage = httpx.Response(200, content=lines[-1][len("data: ") :]).json()["usage"]
        metrics = c.metrics()
    assert usage["prompt_tokens"] == len(SHARED)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 48}
    assert f'splitserve_prefix_hit_tokens_total{{model_name="{MODEL}"}} 48.0' in metrics
    assert f'splitserve_prefix_queried_tokens_total{{model_name="{MODEL}"}} {len(SHARED)}.0' in metrics


def test_chat_usage_reports_cached_tokens(tiny_model_path: Path, script: Script) -> None:
    with cluster(tiny_model_path, script) as c:
        c.prefills[0].num_cached_tokens = 16
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 3}
        usage = httpx.post(f"{c.url}/v1/chat/completions", json=body, timeout=30).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}


def test_cache_reports_feed_the_router_and_the_engine_gauges(script: Script) -> None:
    chain = prefix_hash_chain(SHARED, UNIT, MODEL.encode())
    with cluster(None, script, num_prefill=2) as c:
        assert isinstance(c.router, PrefixAwareRouter)
        held = c.addresses[1]
        c.prefills[1].events.append(prefill_pb2.PrefixEvent(stored=True, block_hash=chain[-1], num_tokens=64))
        assert wait_for(lambda: c.router.index.match(chain) == {held: 64})
        c.complete(SHARED + [1])
        assert [len(p.requests) for p in c.prefills] == [0, 1]
        c.prefills[1].events.append(
            prefill_pb2.PrefixEvent(stored=False, block_hash=chain[-1], num_tokens=64)
        )
        # What the gateway itself sent stays recorded; the event removes only the reported unit.
        assert wait_for(lambda: c.router.index.match(chain[-1:]) == {})
        metrics = c.metrics()
    labels = f'model_name="{MODEL}",worker="{held}"'
    assert f"splitserve_engine_prefix_queried_tokens{{{labels}}} 1000.0" in metrics
    by_tier = f'model_name="{MODEL}",tier="{{}}",worker="{held}"'  # Prometheus sorts the labels
    assert f"splitserve_engine_prefix_hit_tokens{{{by_tier.format('engine')}}} 600.0" in metrics
    assert f"splitserve_engine_prefix_hit_tokens{{{by_tier.format('store')}}} 200.0" in metrics
    assert f"splitserve_engine_prefix_lost_to_missing_state_tokens{{{labels}}} 64.0" in metrics


def test_prompts_sharing_a_prefix_stick_to_one_worker_under_prefix_aware(script: Script) -> None:
    with cluster(None, script, num_prefill=2) as c:
        for i in range(6):
            c.complete(SHARED + [10 + i])
        counts = sorted(len(p.requests) for p in c.prefills)
    assert counts == [0, 6]


def test_least_load_spreads_the_same_prompts(script: Script) -> None:
    with cluster(None, script, num_prefill=2, policy="least_load") as c:
        for i in range(6):
            c.complete(SHARED + [10 + i])
        counts = sorted(len(p.requests) for p in c.prefills)
    assert counts == [3, 3]


def test_a_worker_that_leaves_the_pool_loses_its_gauges_and_its_index_entries(script: Script) -> None:
    chain = prefix_hash_chain(SHARED, UNIT, MODEL.encode())
    with cluster(None, script, num_prefill=2) as c:
        assert isinstance(c.router, PrefixAwareRouter)
        kept, gone = c.addresses
        c.complete(SHARED)
        assert wait_for(lambda: f'worker="{gone}"' in c.metrics() and f'worker="{kept}"' in c.metrics())
        holder = next(a for a, p in zip(c.addresses, c.prefills) if p.requests)
        assert c.router.index.match(chain) == {holder: len(SHARED)}
        c.router.update_workers([kept], c.router.decode_addresses)
        assert wait_for(lambda: f'worker="{gone}"' not in c.metrics())
        assert f'worker="{kept}"' in c.metrics()
        assert c.router.index.match(chain) == ({kept: len(SHARED)} if holder == kept else {})


@dataclass
class ReportingPrefill(FakePrefill):
    """A fake prefill whose cache reports come from the workers' own `CacheReporter`."""

    engine: QueuedPrefixEvents = field(default_factory=QueuedPrefixEvents)
    reporter: CacheReporter = field(default_factory=CacheReporter)

    def CacheReport(self, request, context):  # noqa: N802
        return self.reporter.take(self.engine, request)  # type: ignore[arg-type]


def test_two_gateways_polling_one_worker_each_learn_every_event(script: Script) -> None:
    chain = prefix_hash_chain(SHARED, UNIT, MODEL.encode())
    prefill = ReportingPrefill(script)
    servers = [FakeWorkerServer(prefill), FakeWorkerServer(FakeDecode(script))]
    routers = [PrefixAwareRouter([servers[0].address], [servers[1].address], prefix_unit=UNIT) for _ in "ab"]
    settings = GatewaySettings(model_name=MODEL, max_model_len=512, prefix_unit=UNIT, stats_refresh_s=0.05)
    gateways = [GatewayServer(build_app(settings, None, router), "127.0.0.1", 0) for router in routers]
    try:
        for gateway in gateways:
            gateway.start()
        prefill.engine.pending.append(PrefixEvent("stored", chain[-1], 64))
        held = {servers[0].address: 64}
        assert wait_for(lambda: all(r.index.match(chain) == held for r in routers))
        prefill.engine.pending.append(PrefixEvent("removed", chain[-1], 64))
        assert wait_for(lambda: all(r.index.match(chain) == {} for r in routers))
    finally:
        for gateway in gateways:
            gateway.stop()
        for server in servers:
            server.stop()
