"""The gateway as a Ray actor (no GPU): start, resize its worker pools live, report, stop.

`GatewayActor` is a plain class, so it also runs in a plain process; `remote_gateway_actor()`
wraps it with `ray.remote(num_gpus=0)`. One of several gateway processes (`num_gateways` > 1 in
its settings) shares its port and admits through the deployment's ledger, which the controller
names with `use_ledger` (frontend/ledger_actor.py). This module imports ray only inside
functions and never torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from frontend.app import build_app
from frontend.autoscale_metrics import AutoscaleSeries
from frontend.load_report import load_report
from frontend.router import make_router
from frontend.server import GatewayServer
from frontend.settings import GatewaySettings


class GatewayActor:
    """Owns one gateway: its router (pools), its app and the server thread serving it."""

    def __init__(
        self,
        settings: GatewaySettings | dict[str, Any],
        prefill_addresses: Sequence[str] = (),
        decode_addresses: Sequence[str] = (),
    ) -> None:
        self.settings = settings if isinstance(settings, GatewaySettings) else GatewaySettings(**settings)
        self.router = make_router(self.settings.router_policy, self.settings.prefix_unit)
        self.router.update_workers(list(prefill_addresses), list(decode_addresses))
        self.app = build_app(self.settings, self.settings.model_path, self.router)
        self._autoscale = AutoscaleSeries(self.app.state.pipeline.metrics.registry)
        self._server: GatewayServer | None = None

    def start(self, host: str | None = None, port: int | None = None) -> str:
        """Serve on host:port (settings' by default; port 0 = any free one); returns host:port."""
        if self._server is not None and self._server.running:
            return self._server.address
        host = self.settings.host if host is None else host
        port = self.settings.port if port is None else port
        self._server = GatewayServer(
            self.app, host, port, shared=self.settings.num_gateways > 1, freeze_heap=True
        )
        return self._server.start()

    def use_ledger(self, ledger: Any, gateway_index: int) -> None:
        """Admit through the ledger actor `ledger` as gateway `gateway_index` (a Ray actor only)."""
        import ray

        from frontend.ledger_actor import RayLedgerClient

        me = ray.get_runtime_context().current_actor
        self.app.state.admission_queue.attach(RayLedgerClient(ledger, gateway_index, me))

    def ledger_notice(self, seq: int, contended: bool) -> None:
        """The ledger's word that contention started or ended (see frontend/admission_ledger.py)."""
        self.app.state.admission_queue.notice_threadsafe(seq, contended)

    def update_workers(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        stores: Mapping[str, str] | None = None,
    ) -> None:
        """The pools to route to; `stores` maps each worker's address to its node's store."""
        self.router.update_workers(list(prefill_addresses), list(decode_addresses))
        if stores is not None:
            self.router.update_stores(stores)

    def load_report(self) -> dict[str, Any]:
        """What this gateway knows of its pools' load (frontend/load_report.py), for the autoscaler."""
        return load_report(self.app)

    def publish_autoscale(self, state: Mapping[str, Any]) -> None:
        """The autoscaler's decisions and replica counts, shown on /metrics (frontend/autoscale_metrics.py)."""
        self._autoscale.update(state)

    def health(self) -> dict[str, Any]:
        num_prefill = len(self.router.prefill_addresses)
        num_decode = len(self.router.decode_addresses)
        server = self._server
        return {
            "serving": server is not None and server.running,
            "address": server.address if server is not None else None,
            "own_address": server.own_address if server is not None else None,
            "prefill_workers": num_prefill,
            "decode_workers": num_decode,
            "ready": num_prefill > 0 and num_decode > 0,
        }

    def shutdown(self, drain_timeout_s: float | None = None) -> int:
        """Refuse new requests, give those in flight up to `drain_timeout_s` (the settings' by
        default) to finish, then stop serving; returns how many were still running and got cut."""
        if self._server is None:
            return 0
        admission = self.app.state.admission
        admission.close()
        timeout_s = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        num_cut = admission.wait_idle(timeout_s)
        # The drain was the grace period: cut what is left (uvicorn then skips its lifespan
        # shutdown), or, with nothing left, stop cleanly (idle connections close at once).
        self._server.stop(grace_s=0 if num_cut else 30)
        self._server = None
        return num_cut


def remote_gateway_actor(**ray_options: Any) -> Any:
    """`GatewayActor` as a Ray actor class with no GPU (`num_cpus` etc. may be passed)."""
    import ray

    options = {"num_gpus": 0, **ray_options}
    return ray.remote(**options)(GatewayActor)
