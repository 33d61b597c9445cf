"""The gateway's HTTP surface: OpenAI completions and chat, models, health, metrics.

`build_app` wires settings, tokenizer, router and worker clients into a FastAPI app. Every
request is validated and tokenized before any worker is touched; errors leave as OpenAI JSON.
A streamed response is only started once every prompt has its first token, so capacity and
worker failures before that get a real status code (429, 503) rather than an error event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.clients import WorkerClients
from frontend.errors import GatewayError, error_body, install_error_handlers, model_not_found, unauthorized
from frontend.generate import Generation, Pipeline, Step
from frontend.inputs import require_tokenizer, token_budget, tokenize_chat, tokenize_prompt
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
    install_error_handlers(app)
    app.add_middleware(_CountResponses, metrics=metrics)
    auth = [Depends(_api_key_checker(settings.api_keys))]

    @app.get("/health")
    async def health() -> JSONResponse:
        num_prefill, num_decode = len(router.prefill_addresses), len(router.decode_addresses)
        body = {"prefill_workers": num_prefill, "decode_workers": num_decode}
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
        prompts = [tokenize_prompt(p, tokenizer) for p in body.prompts()]
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

        return await _serve(raw, gens, body.stream, body.include_usage, chunk, whole, usage_chunk)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        arrival_s = time.monotonic()
        _check_model(body.model, settings)
        ids = tokenize_chat(
            body.template_messages(), tokenizer, body.add_generation_prompt, body.chat_template_kwargs
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

        return await _serve(raw, gens, body.stream, body.include_usage, chunk, whole, usage_chunk)

    return app


# Serving ------------------------------------------------------------------------------------


async def _serve(
    raw: Request,
    gens: list[Generation],
    stream: bool,
    include_usage: bool,
    chunk: Callable[[int, Step], list[str]],
    whole: Callable[[list[list[Step]]], Any],
    usage_chunk: Callable[[], str],
) -> Response:
    """Run the generations; a stream once every first token is in, else the whole response."""
    if not stream:
        return await _unless_disconnected(raw, _collect(gens, whole))
    try:
        firsts = await _unless_disconnected(raw, _start_all(gens))
    except BaseException as exc:
        await _release_all(gens, error=not isinstance(exc, asyncio.CancelledError))
        raise
    if isinstance(firsts, Response):  # the client left while we waited
        await _release_all(gens)
        return firsts

    async def events() -> AsyncGenerator[str, None]:
        try:
            async with aclosing(_merged_steps(gens, firsts)) as steps:
                async for index, step in steps:
                    for data in chunk(index, step):
                        yield f"data: {data}\n\n"
            if include_usage:
                yield f"data: {usage_chunk()}\n\n"
        except GatewayError as exc:
            await _release_all(gens, error=True)
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    body = events()

    async def on_close() -> None:
        await body.aclose()
        await _release_all(gens)

    return _ReleasingStream(body, on_close, media_type="text/event-stream")


async def _collect(gens: list[Generation], whole: Callable[[list[list[Step]]], Any]) -> Any:
    steps: list[list[Step]] = [[] for _ in gens]
    try:
        firsts = await _start_all(gens)
        async with aclosing(_merged_steps(gens, firsts)) as merged:
            async for index, step in merged:
                steps[index].append(step)
    except BaseException as exc:
        await _release_all(gens, error=not isinstance(exc, asyncio.CancelledError))
        raise
    await _release_all(gens)
    return whole(steps)


async def _start_all(gens: list[Generation]) -> list[Step]:
    if len(gens) == 1:
        return [await gens[0].start()]
    return await _all_or_cancel([g.start() for g in gens])


async def _merged_steps(gens: list[Generation], firsts: list[Step]) -> AsyncGenerator[tuple[int, Step], None]:
    """Every generation's steps as they come, firsts first; the caller releases the gens."""
    for index, step in enumerate(firsts):
        yield index, step
    live = [i for i, step in enumerate(firsts) if step.finish_reason is None]
    if len(live) == 1:
        index = live[0]
        while True:
            step = await gens[index].next()
            yield index, step
            if step.finish_reason is not None:
                return
    pending = {asyncio.ensure_future(gens[i].next()): i for i in live}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                step = task.result()
                yield index, step
                if step.finish_reason is None:
                    pending[asyncio.ensure_future(gens[index].next())] = index
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def _all_or_cancel(coros: list[Awaitable[Step]]) -> list[Step]:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _release_all(gens: list[Generation], error: bool = False) -> None:
    with anyio.CancelScope(shield=True):
        for gen in gens:
            await gen.release(error=error)


async def _unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (then a 499, never sent)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return Response(status_code=499)
        raise
    finally:
        watcher.cancel()


class _ReleasingStream(StreamingResponse):
    """A stream that runs `on_close` however it ends: finished, failed or client gone."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


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


def _api_key_checker(api_keys: tuple[str, ...]) -> Callable[[Request], None]:
    keys = frozenset(api_keys)

    def check(request: Request) -> None:
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


__all__ = ["build_app", "error_body"]
