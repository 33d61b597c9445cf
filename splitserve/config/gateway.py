"""The `gateway` section: the OpenAI-compatible HTTP frontend."""

from __future__ import annotations

from pydantic import Field

from splitserve.config.byte_size import ByteSize
from splitserve.config.section import Section


class GatewayConfig(Section):
    """The OpenAI-compatible HTTP frontend (GPU-less, one per cluster, on the head node)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    num_cpus: float = Field(default=0.25, ge=0)
    # a request body past this is a 413 before its JSON is parsed
    max_request_bytes: ByteSize = Field(default=8 * 2**20, ge=1)
    # a text prompt past this many characters is a 400 before it is tokenized; null: 32 per context token
    max_prompt_chars: int | None = Field(default=None, ge=1)
    # requests past the decode pool's room wait in a FIFO queue this long at most; past it, 429
    max_queued_requests: int = Field(default=1024, ge=0)
