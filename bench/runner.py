"""Driving a server with a dataset: arrivals, the concurrency cap, sessions, progress, the result.

`run_benchmark(dataset, RunConfig(...))` sends every request as a stream over one
`httpx.AsyncClient` and returns a `BenchmarkResult`. Single-turn requests are sent at their
arrival times; multi-turn sessions start at theirs and send their turns one after another, each
turn once the previous reply is in. `max_concurrency` caps the requests in flight (a turn
waiting for a slot counts from when it is sent, not from when it was due).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
from tqdm import tqdm

from bench.api import ENDPOINTS, endpoint_url, streaming_body
from bench.arrivals import arrival_offsets, check_arrivals
from bench.client import StreamResult, stream_request
from bench.datasets import BenchRequest, Conversation, Dataset, Session, TokenConversation
from bench.datasets.multi_turn_ids import TOKEN_ID_FIELDS
from bench.metrics import check_slo_names, summarize
from bench.options import check_dataset_endpoint
from bench.records import RequestRecord
from bench.result import BenchmarkResult
from bench.tokenizer import BenchTokenizer

DEFAULT_REQUEST_TIMEOUT_S = 6 * 3600.0


@dataclass(frozen=True)
class RunConfig:
    """How to drive the server: where, which endpoint, how fast, how many at once, what is good.

    `request_rate` is requests (or, for multi-turn, sessions) per second, `math.inf` for all at
    once; `slos_ms` maps ttft/tpot/e2el to limits for goodput; `extra_body` is merged into every
    request body (e.g. `{"temperature": 0}`).
    """

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    think_time_s: float = 0.0  # multi-turn: a session's pause between a reply and its next turn
    seed: int = 0
    slos_ms: dict[str, float] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    extra_body: dict[str, Any] = field(default_factory=dict)
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose one of {', '.join(ENDPOINTS)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1 (got {self.max_concurrency})")
        if self.think_time_s < 0:
            raise ValueError(f"think_time_s must be >= 0 (got {self.think_time_s})")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive (got {self.request_timeout_s})")
        check_slo_names(self.slos_ms)
        check_arrivals(self.request_rate, self.burstiness)

    def to_dict(self) -> dict[str, Any]:
        """The config as recorded in a result; the API key is left out."""
        out = asdict(self)
        del out["api_key"]
        return out


async def run_benchmark(
    dataset: Dataset,
    config: RunConfig,
    tokenizer: BenchTokenizer | None = None,
    *,
    client: httpx.AsyncClient | None = None,
) -> BenchmarkResult:
    """Send `dataset` to the server `config` names and measure every request.

    `tokenizer` counts output tokens when the server reports no usage. Pass `client` to reuse
    one (its limits and headers then apply, not `config`'s); otherwise one is made and closed.
    """
    check_dataset_endpoint(dataset, config.endpoint)
    owned = _make_client(config, dataset.num_requests) if client is None else contextlib.nullcontext(client)
    async with owned as http:
        run = _Run(http, config, tokenizer, dataset.num_requests)
        try:
            started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            run.start_s = time.perf_counter()
            per_task = await asyncio.gather(*_tasks(run, dataset, config))
            duration_s = time.perf_counter() - run.start_s
        finally:
            run.progress.close()
    records = tuple(sorted((r for rs in per_task for r in rs), key=lambda r: r.index))
    return BenchmarkResult(
        dataset=dataset.name,
        started_at=started_at,
        summary=summarize(records, duration_s, config.slos_ms),
        records=records,
        arguments=config.to_dict(),
    )


def _tasks(run: _Run, dataset: Dataset, config: RunConfig) -> list[Coroutine[Any, Any, list[RequestRecord]]]:
    if dataset.is_multi_turn:
        offsets = arrival_offsets(len(dataset.sessions), config.request_rate, config.burstiness, config.seed)
        first_indices, next_index = [], 0
        for session in dataset.sessions:
            first_indices.append(next_index)
            next_index += len(session.turns)
        return [run.session(i, s, t) for i, s, t in zip(first_indices, dataset.sessions, offsets)]
    offsets = arrival_offsets(len(dataset.requests), config.request_rate, config.burstiness, config.seed)
    return [run.single(i, r, t) for i, (r, t) in enumerate(zip(dataset.requests, offsets))]


class _Run:
    """One run's shared state: the client, the concurrency cap, the progress bar and the start."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        config: RunConfig,
        tokenizer: BenchTokenizer | None,
        num_requests: int,
    ) -> None:
        self.client = client
        self.config = config
        self.tokenizer = tokenizer
        self.url = endpoint_url(config.base_url, config.endpoint)
        self.slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        self.progress = tqdm(total=num_requests, desc="bench serve", unit="req", disable=config.disable_tqdm)
        self.start_s = 0.0

    async def single(self, index: int, request: BenchRequest, offset_s: float) -> list[RequestRecord]:
        await self._wait_until(offset_s)
        if self.config.endpoint == "chat":
            prompt: Any = request.messages()
        else:
            prompt = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
        record, _ = await self._send(index, prompt, request.prompt_len, request.output_len)
        return [record]

    async def session(self, first_index: int, session: Session, offset_s: float) -> list[RequestRecord]:
        await self._wait_until(offset_s)
        conversation = Conversation()
        id_conversation = TokenConversation()
        records: list[RequestRecord] = []
        for turn_index, turn in enumerate(session.turns):
            index = first_index + turn_index
            if records and not records[-1].success:
                records.append(self._not_sent(index, session, turn_index, turn.output_len))
                continue
            where = {"session_id": session.session_id, "turn_index": turn_index}
            if turn_index and self.config.think_time_s:
                await asyncio.sleep(self.config.think_time_s)  # the user reads the reply (no slot held)
            if isinstance(turn.user_message, tuple):
                # Token ids: the reply goes back as the ids the server generated, never through text.
                id_conversation.ask(turn.user_message)
                prompt_ids = id_conversation.prompt()
                record, stream = await self._send(
                    index, prompt_ids, len(prompt_ids), turn.output_len, want_token_ids=True, **where
                )
                id_conversation.answer(stream.token_ids)
            else:
                conversation.ask(turn.user_message)
                prompt: Any = (
                    conversation.messages() if self.config.endpoint == "chat" else conversation.text()
                )
                prompt_len = self._count(conversation.text())
                record, stream = await self._send(index, prompt, prompt_len, turn.output_len, **where)
                conversation.answer(stream.text)
            records.append(record)
        return records

    async def _send(
        self,
        index: int,
        prompt: Any,
        prompt_len: int,
        max_tokens: int,
        *,
        want_token_ids: bool = False,
        **where: int,
    ) -> tuple[RequestRecord, StreamResult]:
        extra_body = (
            {**TOKEN_ID_FIELDS, **self.config.extra_body} if want_token_ids else self.config.extra_body
        )
        body = streaming_body(self.config.endpoint, self.config.model, prompt, max_tokens, extra_body)
        async with self.slots or contextlib.nullcontext():
            stream = await stream_request(
                self.client, self.url, body, self.config.endpoint, want_token_ids=want_token_ids
            )
        if want_token_ids and stream.success and not stream.token_ids:
            stream = dataclasses.replace(
                stream,
                error="the stream named no token ids (logprobs 'token_id:N'); the multi-turn-ids dataset "
                "needs a server that honours return_tokens_as_token_ids",
            )
        self.progress.update(1)
        record = RequestRecord.from_stream(
            stream,
            index=index,
            benchmark_start_s=self.start_s,
            prompt_tokens=prompt_len,
            max_tokens=max_tokens,
            tokenizer=self.tokenizer,
            **where,
        )
        return record, stream

    def _not_sent(self, index: int, session: Session, turn_index: int, max_tokens: int) -> RequestRecord:
        self.progress.update(1)
        return RequestRecord(
            index=index,
            success=False,
            start_s=time.perf_counter() - self.start_s,
            prompt_tokens=0,
            max_tokens=max_tokens,
            error=f"not sent: an earlier turn of session {session.session_id} failed",
            session_id=session.session_id,
            turn_index=turn_index,
        )

    def _count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if self.tokenizer is not None else 0

    async def _wait_until(self, offset_s: float) -> None:
        delay_s = self.start_s + offset_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)


def _make_client(config: RunConfig, num_requests: int) -> httpx.AsyncClient:
    connections = config.max_concurrency or max(1, num_requests)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(config.request_timeout_s),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )
