"""Fixtures: the tiny model's tokenizer, fake workers on real gRPC servers, a real gateway."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from frontend.app import build_app
from frontend.router import LeastLoadRouter
from frontend.server import GatewayServer
from frontend.settings import GatewaySettings
from splitserve.tokenizer import Tokenizer
from tests.frontend.fakes import FakeDecode, FakePrefill, FakeWorkerServer, Script

MODEL = "tiny-kimi"
SCRIPT_TEXT = "Hello world! The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


@dataclass
class Gateway:
    """A running gateway and the fakes behind it."""

    url: str
    router: LeastLoadRouter
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    settings: GatewaySettings

    @property
    def prefill(self) -> FakePrefill:
        return self.prefills[0]

    @property
    def decode(self) -> FakeDecode:
        return self.decodes[0]

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=30)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)


@contextlib.contextmanager
def running_gateway(
    tokenizer_path: Path | None,
    script: Script,
    num_prefill: int = 1,
    num_decode: int = 1,
    extra_prefill_addresses: Sequence[str] = (),
    extra_decode_addresses: Sequence[str] = (),
    colocated: bool = False,
    **settings_overrides: object,
) -> Iterator[Gateway]:
    """Fake workers on real gRPC servers and the real app under real uvicorn; all stopped after.

    `colocated`: worker i serves both prefills[i] and decodes[i] on one address, and both pools
    list it (as in `mode: colocated`); num_prefill must equal num_decode."""
    prefills = [FakePrefill(script) for _ in range(num_prefill)]
    decodes = [FakeDecode(script) for _ in range(num_decode)]
    servers: list[FakeWorkerServer] = []
    gateway_server: GatewayServer | None = None
    try:
        if colocated:
            assert num_prefill == num_decode, "a colocated worker serves one prefill and one decode fake"
            servers = [FakeWorkerServer(p, d) for p, d in zip(prefills, decodes)]
            prefill_addresses = decode_addresses = [s.address for s in servers]
        else:
            servers = [FakeWorkerServer(f) for f in [*prefills, *decodes]]
            prefill_addresses = [s.address for s in servers[:num_prefill]]
            decode_addresses = [s.address for s in servers[num_prefill:]]
        prefill_addresses = [*prefill_addresses, *extra_prefill_addresses]
        decode_addresses = [*decode_addresses, *extra_decode_addresses]
        settings = GatewaySettings(
            **{"model_name": MODEL, "max_model_len": 256, "rpc_timeout_s": 5.0, **settings_overrides}
        )
        router = LeastLoadRouter(prefill_addresses, decode_addresses)
        app = build_app(settings, tokenizer_path, router)
        gateway_server = GatewayServer(app, "127.0.0.1", 0)
        gateway_server.start()
        yield Gateway(gateway_server.url, router, prefills, decodes, settings)
    finally:
        if gateway_server is not None:
            gateway_server.stop()
        for server in servers:
            server.stop()


@pytest.fixture
def script(tokenizer: Tokenizer) -> Script:
    return Script(tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))


@pytest.fixture
def gateway(tiny_model_path: Path, script: Script) -> Iterator[Gateway]:
    with running_gateway(tiny_model_path, script) as gw:
        yield gw
