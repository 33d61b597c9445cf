"""The gateway's settings: one validated, frozen object built once at start."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CHARS_PER_TOKEN_BOUND = 32  # characters per context token past which a prompt is refused untokenized


class GatewaySettings(BaseModel):
    """What the gateway serves, where it listens and how long it waits.

    `max_model_len` is the context limit the gateway enforces before any worker is touched
    (prompt plus generated tokens). Times are seconds (`_s`). Frozen: never mutated after load.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model_name: str = Field("splitserve", min_length=1, description="the served model name (`model` field)")
    model_path: str | None = Field(None, description="checkpoint folder; its tokenizer.json is loaded")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: tuple[str, ...] = Field((), description="empty: no authentication")
    max_model_len: int = Field(4096, ge=2)
    request_timeout_s: float = Field(600.0, gt=0, description="whole request, prefill to last token")
    rpc_timeout_s: float = Field(10.0, gt=0, description="unary control RPCs: Reserve, Abort, Stats")
    reserve_timeout_s: float = Field(
        600.0, gt=0, description="the decode's wait for the prefill's state; lapses at 2x if no Decode comes"
    )
    state_lease_s: float = Field(0.0, ge=0, description="lease of transferred state; 0 = store default")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on stop, how long requests in flight may take to finish"
    )
    stats_refresh_s: float = Field(
        0.5, gt=0, description="how often decode Stats and prefill cache reports are re-read"
    )
    enable_prefix_caching: bool = Field(
        True, description="hash each prompt's prefix chain and send it with the prefill (cache.*)"
    )
    prefix_unit: int = Field(64, ge=1, description="tokens per prefix hash (cache.prefix_unit)")
    router_policy: Literal["prefix_aware", "least_load", "round_robin"] = Field(
        "prefix_aware", description="how workers are picked (router.policy)"
    )
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="uncached prompt tokens a decode worker may prefill itself (router.*)"
    )
    max_queued_requests: int = Field(
        1024, ge=0, description="requests waiting for decode room; past it, 429 with Retry-After"
    )
    prefill_fallback: Literal["decode_local", "fail"] = Field(
        "decode_local", description="with no prefill worker: the decode worker prefills, or 503"
    )
    decode_failover: bool = Field(
        True, description="resume a stream whose decode worker was lost on another (decode.failover)"
    )
    max_decode_failovers: int = Field(3, ge=0, description="decode workers one request may lose")
    decode_failover_wait_s: float = Field(
        60.0,
        ge=0,
        description="how long a request waits for a reachable decode worker (decode.failover_wait_s)",
    )
    max_request_bytes: int = Field(
        8 * 2**20, ge=1, description="request body limit: past it a 413, before the JSON is parsed"
    )
    max_prompt_chars: int | None = Field(
        None,
        ge=1,
        description="a text prompt's character limit, checked before tokenizing; "
        "None: CHARS_PER_TOKEN_BOUND per token of max_model_len",
    )
    # Slow or idle clients (frontend.http_protocol): what bounds the connections they hold.
    header_read_timeout_s: float = Field(
        30.0, gt=0, description="a request's line and headers must arrive within it (a new connection's too)"
    )
    body_read_timeout_s: float = Field(30.0, gt=0, description="longest silence within a request body")
    request_read_timeout_s: float = Field(
        120.0, gt=0, description="a whole request, headers and body, must arrive within it"
    )
    keep_alive_timeout_s: float = Field(30.0, gt=0, description="an idle connection between requests")
    max_connections_per_client: int | None = Field(
        1024, ge=1, description="open connections one client address may hold; None: no cap"
    )
    num_gateways: int = Field(
        1,
        ge=1,
        description="gateway processes of the deployment; past 1 they share the port (SO_REUSEPORT), "
        "split max_connections_per_client and admit through one shared ledger",
    )

    @property
    def prompt_chars_limit(self) -> int:
        """The character limit in force: `max_prompt_chars`, or one no prompt that fits the
        context comes near (tokens of common tokenizers average under 8 characters)."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN_BOUND * self.max_model_len
