"""The `gateway` section: the OpenAI-compatible HTTP frontend, and where its API keys come from."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from splitserve.config.byte_size import ByteSize
from splitserve.config.section import Section

GatewayPlacement = Literal["head", "every_node"]
MAX_GATEWAY_REPLICAS = 64


class GatewayConfig(Section):
    """The OpenAI-compatible HTTP frontend (GPU-less): `replicas` processes on the head node, or on
    every node (`placement: every_node`, behind the user's load balancer). Processes on one node
    share its port (SO_REUSEPORT: the kernel spreads new connections over them)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # gateway processes per node that runs gateways; each reserves num_cpus
    replicas: int = Field(default=1, ge=1, le=MAX_GATEWAY_REPLICAS)
    # head: on the Ray head node only; every_node: on every node alive at start, one port each
    placement: GatewayPlacement = "head"
    num_cpus: float = Field(default=0.25, ge=0)
    # a request body past this is a 413 before its JSON is parsed
    max_request_bytes: ByteSize = Field(default=8 * 2**20, ge=1)
    # a text prompt past this many characters is a 400 before it is tokenized; null: 32 per context token
    max_prompt_chars: int | None = Field(default=None, ge=1)
    # requests past the decode pool's room wait in a FIFO queue this long at most; past it, 429
    max_queued_requests: int = Field(default=1024, ge=0)
    # Slow and idle clients. A request's line and headers must arrive within header_read_timeout_s
    # (a new connection that sends nothing is closed after it); a body may fall silent for at most
    # body_read_timeout_s; the whole request must arrive within request_read_timeout_s; an idle
    # connection between requests is closed after keep_alive_timeout_s. Past these, a 408 and close.
    header_read_timeout_s: float = Field(default=30, gt=0)
    body_read_timeout_s: float = Field(default=30, gt=0)
    request_read_timeout_s: float = Field(default=120, gt=0)
    keep_alive_timeout_s: float = Field(default=30, gt=0)
    # open connections one client address may hold; past it, a 429 and close; null: no cap
    max_connections_per_client: int | None = Field(default=1024, ge=1)
    # the API keys from outside the file instead (at most one of api_keys, api_keys_env, api_keys_file):
    # an environment variable of the head node's Ray, or a file there (gateway_api_keys reads them)
    api_keys_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    api_keys_file: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _port_shareable(self) -> GatewayConfig:
        if (self.replicas > 1 or self.placement == "every_node") and not hasattr(socket, "SO_REUSEPORT"):
            raise ValueError(
                "gateway: several gateway processes share one port with SO_REUSEPORT, which this "
                "platform lacks; set gateway.replicas: 1 and gateway.placement: head"
            )
        return self

    @model_validator(mode="after")
    def _one_source_of_api_keys(self) -> GatewayConfig:
        given = [k for k in ("api_keys", "api_keys_env", "api_keys_file") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"gateway: give the API keys one way, not {' and '.join(given)}")
        return self


_KEY_SEPARATORS = re.compile(r"[\s,]+")


def gateway_api_keys(gateway: GatewayConfig) -> tuple[str, ...]:
    """The bearer tokens the gateway accepts: `api_keys`, or those read now from the variable
    `api_keys_env` (separated by commas or whitespace) or the file `api_keys_file` (one a line;
    blank lines and lines starting with # skipped), in this process's environment and filesystem.

    Raises ValueError naming the variable or file (never a key) when it is unset, unreadable or
    holds no key: an empty list would turn authentication off.
    """
    if gateway.api_keys_env:
        name = gateway.api_keys_env
        keys = tuple(k for k in _KEY_SEPARATORS.split(os.environ.get(name, "")) if k)
        if not keys:
            state = "is not set" if name not in os.environ else "holds no key"
            raise ValueError(
                f"gateway.api_keys_env: the variable {name} {state} in the environment of the process "
                "that builds the gateway (the Ray head node's: set it where Ray was started)"
            )
        return keys
    if gateway.api_keys_file:
        path = Path(gateway.api_keys_file).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(
                f"gateway.api_keys_file: cannot read {path} ({exc.strerror or exc}); it must be on the "
                "Ray head node, where the gateway is built"
            ) from None
        keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
        if not keys:
            raise ValueError(f"gateway.api_keys_file: {path} holds no key (one a line)")
        return keys
    return gateway.api_keys
