"""What every generation needs from the gateway: settings, router, worker clients, metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from frontend.clients import WorkerClients
from frontend.metrics import GatewayMetrics
from frontend.prefix_metrics import PrefixMetrics
from frontend.router import Router
from frontend.settings import GatewaySettings
from splitserve.prefix_hash import grow_chain
from splitserve.tokenizer import Tokenizer


async def _always_reachable(address: str) -> bool:
    return True


@dataclass
class Pipeline:
    """Everything a generation needs from the gateway; built once per app."""

    settings: GatewaySettings
    router: Router
    clients: WorkerClients
    metrics: GatewayMetrics
    tokenizer: Tokenizer | None
    on_route: Callable[[str], None] = field(default=lambda store_address: None)
    prefix_metrics: PrefixMetrics | None = None
    # asks one worker at once whether it answers, marking it in the router (LoadMonitor.probe)
    probe: Callable[[str], Awaitable[bool]] = field(default=_always_reachable)

    def prefix_hashes(self, prompt_ids: list[int]) -> list[bytes]:
        """The prompt's prefix chain, salted with the served model name; empty with caching off."""
        return self.grown_prefix_hashes([], prompt_ids)

    def grown_prefix_hashes(self, chain: list[bytes], token_ids: list[int]) -> list[bytes]:
        """`chain` (of the first units of `token_ids`) grown over all of them; empty with caching off."""
        if not self.settings.enable_prefix_caching:
            return []
        salt = self.settings.model_name.encode()
        return grow_chain(chain, token_ids, self.settings.prefix_unit, salt)
