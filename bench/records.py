"""`RequestRecord`: what one benchmark request measured, derived from what its stream returned."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bench.client import StreamResult
from bench.tokenizer import BenchTokenizer


@dataclass(frozen=True)
class RequestRecord:
    """One request's outcome and timings, in seconds; the metrics are computed from these alone.

    `start_s` is when it was sent, from the benchmark's start; `ttft_s` (first content chunk)
    and `e2e_s` (end of the stream) count from the send; `itl_s` holds every gap between
    successive content chunks. A failed request has `success` False, its `error` text, and no
    latencies. `session_id` and `turn_index` place a multi-turn request in its conversation.
    `cached_tokens` is the server's count of prompt tokens it served from a prefix cache (None:
    it did not say).
    """

    index: int
    success: bool
    start_s: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    e2e_s: float | None = None
    error: str = ""
    session_id: int | None = None
    turn_index: int | None = None
    cached_tokens: int | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for failures and single-token outputs."""
        if not self.success or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @classmethod
    def from_stream(
        cls,
        stream: StreamResult,
        *,
        index: int,
        benchmark_start_s: float,
        prompt_tokens: int,
        max_tokens: int,
        tokenizer: BenchTokenizer | None = None,
        session_id: int | None = None,
        turn_index: int | None = None,
    ) -> RequestRecord:
        """The record of `stream`; server-reported usage wins over `prompt_tokens` and local counts."""
        common: dict[str, Any] = {
            "index": index,
            "start_s": stream.send_s - benchmark_start_s,
            "prompt_tokens": stream.prompt_tokens if stream.prompt_tokens is not None else prompt_tokens,
            "max_tokens": max_tokens,
            "session_id": session_id,
            "turn_index": turn_index,
            "cached_tokens": stream.cached_tokens,
        }
        if not stream.success:
            return cls(success=False, error=stream.error, **common)
        chunks = stream.chunk_s
        return cls(
            success=True,
            output_tokens=count_output_tokens(stream, tokenizer),
            ttft_s=chunks[0] - stream.send_s,
            itl_s=tuple(b - a for a, b in zip(chunks, chunks[1:])),
            e2e_s=stream.end_s - stream.send_s,
            **common,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["itl_s"] = list(self.itl_s)
        out["tpot_s"] = self.tpot_s
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        values = {k: v for k, v in data.items() if k != "tpot_s"}
        values["itl_s"] = tuple(values.get("itl_s", ()))
        return cls(**values)


def count_output_tokens(stream: StreamResult, tokenizer: BenchTokenizer | None) -> int:
    """The server's `usage.completion_tokens` when it sent one, else the tokenizer's count of the
    text, else the number of content chunks."""
    if stream.completion_tokens is not None:
        return stream.completion_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(stream.text, add_special_tokens=False))
    return len(stream.chunk_s)
