"""Fixtures: the tiny model's tokenizer files, and an instant worker behind the real gateway."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from experiments.instant_worker import InstantConfig, instant_worker_process
from frontend.app import build_app
from frontend.router import LeastLoadRouter
from frontend.server import GatewayServer
from frontend.settings import GatewaySettings
from splitserve.tokenizer import Tokenizer
from splitserve.tokenizer_files import EOS_TOKEN

MODEL = "instant"


@dataclass(frozen=True)
class InstantGateway:
    """The gateway's base URL and the instant worker's address behind it."""

    url: str
    worker_address: str

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def instant_gateway(tokenizer_dir: Path, tokenizer: Tokenizer) -> Iterator[InstantGateway]:
    """An instant worker in its own process behind the real gateway (in-process uvicorn)."""
    config = InstantConfig(eos_token_id=tokenizer.token_to_id(EOS_TOKEN))
    with instant_worker_process(config) as worker:
        router = LeastLoadRouter([worker.address], [worker.address])
        settings = GatewaySettings(model_name=MODEL, max_model_len=256)
        server = GatewayServer(build_app(settings, tokenizer_dir, router), "127.0.0.1", 0)
        server.start()
        try:
            yield InstantGateway(server.url, worker.address)
        finally:
            server.stop()
