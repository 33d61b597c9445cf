"""How requests are served across the pools: hybrid prefix caching and the gateway's router."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from splitserve.config.byte_size import ByteSize
from splitserve.config.section import Section


class CacheConfig(Section):
    """Hybrid prefix caching (docs/ARCHITECTURE.md, "Prefix caching").

    A prefix is named by a chain of hashes, one per `prefix_unit` prompt tokens; it is reusable
    only where every MLA layer's KV and a KDA state snapshot at that exact boundary both exist.
    Snapshots are kept at every prompt end and at the end of every finished request (prompt +
    reply); every `retention_interval` tokens (0: none); and, with `selective_retention`, at a
    boundary the engine has seen a second time. `snapshot_memory_bytes` is each worker's pool
    for them (on top of `<pool>.kv_cache_memory_bytes`).
    """

    enable_prefix_caching: bool = True
    prefix_unit: int = Field(default=64, ge=1)
    retention_interval: int = Field(default=0, ge=0)
    selective_retention: bool = True
    snapshot_memory_bytes: ByteSize = 64 * 2**20


class RouterConfig(Section):
    """How the gateway picks workers: `prefix_aware` (matched prefix tokens balanced against
    load), `least_load` or `round_robin`.

    `local_prefill_max_tokens` (conditional disaggregation): a prompt of which at most this many
    tokens are not already cached on a decode worker with room is computed by that decode worker
    itself, with no prefill worker and no state handoff (the next turn of a conversation, whose
    history the decode worker kept when the last turn finished; a short prompt). The decode
    worker checks its own cache and refuses when it holds less than the gateway believed; the
    prompt then goes to a prefill worker as usual. Each such prefill runs in the decode batch,
    so it is bounded: 0 (the default) sends every prompt to a prefill worker.
    """

    policy: Literal["prefix_aware", "least_load", "round_robin"] = "prefix_aware"
    local_prefill_max_tokens: int = Field(default=0, ge=0)
