"""The gateway's HTTP app: OpenAI completions and chat, models, health, metrics.

`build_app` wires settings, tokenizer, router and worker clients into a FastAPI app; the
routes live in `frontend.routes`, one module per concern. Every request is validated and
tokenized before any worker is touched; errors leave as OpenAI JSON (`frontend.errors`).
A streamed response is only started once every prompt has its first token, so capacity and
worker failures before that get a real status code (429, 503) rather than an error event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI

from frontend.admission import Admission
from frontend.admission_queue import AdmissionQueue, QueueMetrics, SlotAdmission
from frontend.auth import api_key_checker
from frontend.body_limit import BodyLimit
from frontend.cache_monitor import CacheMonitor
from frontend.clients import WorkerClients
from frontend.direct_routes import DirectRoute, DirectRoutes
from frontend.errors import install_error_handlers
from frontend.front_door import FrontDoor
from frontend.generate import Pipeline
from frontend.load_monitor import LoadMonitor
from frontend.metrics import GatewayMetrics
from frontend.openapi import install_openapi
from frontend.prefix_metrics import PrefixMetrics
from frontend.router import Router, make_router
from frontend.routes import chat, completions, health, metrics, models
from frontend.schema_bounds import Bounds
from frontend.settings import GatewaySettings
from frontend.shared_admission import SharedAdmissionQueue
from splitserve.tokenizer import Tokenizer


def build_app(
    settings: GatewaySettings,
    tokenizer_path: str | Path | None = None,
    router: Router | None = None,
    clients: WorkerClients | None = None,
) -> FastAPI:
    """The gateway app. No tokenizer (None, or a folder without tokenizer.json): token ids only."""
    tokenizer = Tokenizer.maybe_load(tokenizer_path) if tokenizer_path is not None else None
    router = router if router is not None else make_router(settings.router_policy, settings.prefix_unit)
    clients = clients if clients is not None else WorkerClients(settings.rpc_timeout_s)
    gateway_metrics = GatewayMetrics(settings.model_name)
    # one gateway process admits alone; several admit through the deployment's ledger
    queue_class = SharedAdmissionQueue if settings.num_gateways > 1 else AdmissionQueue
    queue = queue_class(
        settings.max_queued_requests, QueueMetrics(gateway_metrics), lambda: bool(router.decode_addresses)
    )
    monitor = LoadMonitor(router, clients, gateway_metrics, settings.stats_refresh_s, queue.set_capacity)
    prefix_metrics = PrefixMetrics(gateway_metrics)
    cache_monitor = (
        CacheMonitor(router, clients, prefix_metrics, settings.stats_refresh_s)
        if settings.enable_prefix_caching
        else None
    )
    pipeline = Pipeline(
        settings, router, clients, gateway_metrics, tokenizer, monitor.on_route, prefix_metrics, monitor.probe
    )

    app = FastAPI(title="splitserve gateway", lifespan=_lifespan(monitor, clients, cache_monitor, queue))
    app.state.settings = settings  # the server reads its connection limits here (frontend.server)
    app.state.on_refusal = gateway_metrics.observe_refusal  # and counts what its protocol refuses
    app.state.pipeline = pipeline
    app.state.monitor = monitor
    app.state.cache_monitor = cache_monitor
    app.state.admission = admission = Admission()
    app.state.admission_queue = queue
    install_error_handlers(app, gateway_metrics.observe_refusal)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else None
    install_openapi(app, Bounds(settings.max_model_len, settings.prompt_chars_limit, vocab_size))
    app.include_router(health.router)
    app.include_router(metrics.router)
    check_key = api_key_checker(settings.api_keys)
    for api in (models, completions, chat):
        app.include_router(api.router, dependencies=[Depends(check_key)])
    # the generation routes' well-formed requests skip FastAPI's routing (frontend.direct_routes)
    direct = DirectRoutes(
        {
            "/v1/completions": DirectRoute.of(completions.completions),
            "/v1/chat/completions": DirectRoute.of(chat.chat_completions),
        },
        check_key,
    )
    body_limit = BodyLimit(settings.max_request_bytes, gateway_metrics.observe_refusal)
    app.add_middleware(
        FrontDoor, metrics=gateway_metrics, admission=admission, body_limit=body_limit, direct=direct
    )
    return app


def _lifespan(
    monitor: LoadMonitor,
    clients: WorkerClients,
    cache_monitor: CacheMonitor | None = None,
    queue: SlotAdmission | None = None,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """What runs while the app serves: the load monitor (and the prefix cache poll, with caching
    on; and a shared admission queue's registration with its ledger); on the way out, the
    channels close."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if isinstance(queue, SharedAdmissionQueue):
            queue.start()
        monitor.start()
        if cache_monitor is not None:
            cache_monitor.start()
        try:
            yield
        finally:
            await monitor.stop()
            if cache_monitor is not None:
                await cache_monitor.stop()
            await clients.close()

    return lifespan


__all__ = ["build_app"]
