"""The gateway's HTTP surface: OpenAI completions and chat, models, health, metrics.

`build_app` wires settings, tokenizer, router and worker clients into a FastAPI app. Every
request is validated and tokenized before any worker is touched; errors leave as OpenAI JSON.
A streamed response is only started once every prompt has its first token, so capacity and
worker failures before that get a real status code (429, 503) rather than an error event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.admission import Admission, AdmissionMiddleware
from frontend.clients import WorkerClients
from frontend.errors import install_error_handlers, model_not_found, unauthorized
from frontend.generate import Generation, Pipeline, Step
from frontend.inputs import (
    messages_chars,
    off_the_loop_if_long,
    prompt_chars,
    require_tokenizer,
    token_budget,
    tokenize_chat,
    tokenize_prompt,
)
from frontend.load_monitor import LoadMonitor
from frontend.metrics import GatewayMetrics
from frontend.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
)
from frontend.responses import TokenRenderer, concat_steps, usage
from frontend.router import LeastLoadRouter, Router
from frontend.serving import serve
from frontend.settings import GatewaySettings
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import Tokenizer


def build_app(
    settings: GatewaySettings,
    tokenizer_path: str | Path | None = None,
    router: Router | None = None,
    clients: WorkerClients | None = None,
) -> FastAPI:
    """The gateway app. No tokenizer (None, or a folder without tokenizer.json): token ids only."""
    tokenizer = Tokenizer.maybe_load(tokenizer_path) if tokenizer_path is not None else None
    router = router if router is not None else LeastLoadRouter()
    clients = clients if clients is not None else WorkerClients(settings.rpc_timeout_s)
    metrics = GatewayMetrics(settings.model_name)
    monitor = LoadMonitor(router, clients, metrics, settings.stats_refresh_s)

    def on_route(store_address: str) -> None:
        monitor.saw_store(store_address)
        monitor.kick()

    pipeline = Pipeline(settings, router, clients, metrics, tokenizer, on_route)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        monitor.start()
        try:
            yield
        finally:
            await monitor.stop()
            await clients.close()

    app = FastAPI(title="splitserve gateway", lifespan=lifespan)
    app.state.pipeline = pipeline
    app.state.monitor = monitor
    app.state.admission = admission = Admission()
    install_error_handlers(app)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    app.add_middleware(_CountResponses, metrics=metrics)  # outermost: counts the draining 503s too
    auth = [Depends(_api_key_checker(settings.api_keys))]

    @app.get("/health")
    async def health() -> JSONResponse:
        num_prefill, num_decode = len(router.prefill_addresses), len(router.decode_addresses)
        body = {"prefill_workers": num_prefill, "decode_workers": num_decode}
        if not admission.is_open:
            return JSONResponse({"status": "draining", **body}, status_code=503)
        ok = num_prefill > 0 and num_decode > 0
        return JSONResponse({"status": "ok" if ok else "no workers", **body}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        metrics.set_workers(len(router.prefill_addresses), len(router.decode_addresses))
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> ModelList:
        card = ModelCard(
            id=settings.model_name, root=settings.model_path, max_model_len=settings.max_model_len
        )
        return ModelList(data=[card])

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        _check_model(body.model, settings)
        texts = body.prompts()
        prompts = await off_the_loop_if_long(
            prompt_chars(texts), lambda: [tokenize_prompt(p, tokenizer) for p in texts]
        )
        params = _params_for(body, prompts, settings, tokenizer, body.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        gens = [
            Generation(pipeline, f"{request_id}-{i}", ids, params, arrival_s) for i, ids in enumerate(prompts)
        ]
        renderers = [TokenRenderer(tokenizer, body.return_tokens_as_token_ids, 0) for _ in gens]

        def choice(index: int, step: Step) -> CompletionChoice:
            return CompletionChoice(
                index=index,
                text=step.text,
                logprobs=renderers[index].completion_logprobs(step),
                finish_reason=step.finish_reason,
                stop_reason=step.stop_reason,
            )

        def chunk(index: int, step: Step) -> list[str]:
            return [
                CompletionResponse(
                    id=request_id, model=settings.model_name, choices=[choice(index, step)]
                ).model_dump_json()
            ]

        def whole(steps: list[list[Step]]) -> CompletionResponse:
            choices = [choice(i, concat_steps(s)) for i, s in enumerate(steps)]
            return CompletionResponse(
                id=request_id, model=settings.model_name, choices=choices, usage=_usage(gens)
            )

        def usage_chunk() -> str:
            return CompletionResponse(
                id=request_id, model=settings.model_name, choices=[], usage=_usage(gens)
            ).model_dump_json()

        return await serve(raw, gens, body.stream, body.include_usage, chunk, whole, usage_chunk)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        _check_model(body.model, settings)
        messages = body.template_messages()
        ids = await off_the_loop_if_long(
            messages_chars(messages),
            lambda: tokenize_chat(messages, tokenizer, body.add_generation_prompt, body.chat_template_kwargs),
        )
        params = _params_for(body, [ids], settings, tokenizer, body.requested_max_tokens())
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        gens = [Generation(pipeline, request_id, ids, params, arrival_s)]
        renderer = TokenRenderer(tokenizer, body.return_tokens_as_token_ids, body.top_logprobs or 0)
        started = [False]

        def chunk(index: int, step: Step) -> list[str]:
            out = []
            if not started[0]:
                started[0] = True
                role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                out.append(
                    ChatCompletionChunk(
                        id=request_id, model=settings.model_name, choices=[role]
                    ).model_dump_json()
                )
            piece = ChatChunkChoice(
                index=index,
                delta=DeltaMessage(content=step.text),
                logprobs=renderer.chat_logprobs(step),
                finish_reason=step.finish_reason,
                stop_reason=step.stop_reason,
            )
            out.append(
                ChatCompletionChunk(
                    id=request_id, model=settings.model_name, choices=[piece]
                ).model_dump_json()
            )
            return out

        def whole(steps: list[list[Step]]) -> ChatCompletionResponse:
            step = concat_steps(steps[0])
            choice = ChatChoice(
                index=0,
                message=ChatMessageOut(content=step.text),
                logprobs=renderer.chat_logprobs(step),
                finish_reason=step.finish_reason,
                stop_reason=step.stop_reason,
            )
            return ChatCompletionResponse(
                id=request_id, model=settings.model_name, choices=[choice], usage=_usage(gens)
            )

        def usage_chunk() -> str:
            return ChatCompletionChunk(
                id=request_id, model=settings.model_name, choices=[], usage=_usage(gens)
            ).model_dump_json()

        return await serve(raw, gens, body.stream, body.include_usage, chunk, whole, usage_chunk)

    return app


# Request checks -----------------------------------------------------------------------------


def _params_for(
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    settings: GatewaySettings,
    tokenizer: Tokenizer | None,
    max_tokens: int | None,
) -> SamplingParams:
    budgets = [token_budget(len(ids), max_tokens, settings.max_model_len) for ids in prompts]
    params = body.sampling_params(min(budgets))
    if params.stop:
        require_tokenizer(tokenizer, "stop strings")
    return params


def _usage(gens: list[Generation]) -> Any:
    return usage(sum(len(g.prompt_ids) for g in gens), sum(g.num_generated_tokens for g in gens))


def _check_model(model: str | None, settings: GatewaySettings) -> None:
    if model is not None and model != settings.model_name:
        raise model_not_found(model, settings.model_name)


def _api_key_checker(api_keys: tuple[str, ...]) -> Callable[[Request], Awaitable[None]]:
    keys = frozenset(api_keys)

    async def check(request: Request) -> None:  # async: FastAPI would run a plain def in a thread pool
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in keys:
            raise unauthorized()

    return check


_ROUTES = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


class _CountResponses:
    """ASGI middleware counting responses by route and status (streams included)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in _ROUTES else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.observe_response(route, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            self.metrics.observe_response(route, 500)
            raise


__all__ = ["build_app"]
