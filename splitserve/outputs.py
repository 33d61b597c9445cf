"""Results the engine hands back, shaped like vLLM's `RequestOutput` so nobody learns new words."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated continuation: its tokens, text, per-token logprobs and why it stopped.

    `logprobs`, when requested, holds one `{token_id: logprob}` dict per generated token with the
    top-n tokens and the sampled one. `finish_reason` is "stop" (EOS, stop token or stop string),
    "length" (`max_tokens` or the context limit) or None while still running.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return sum(lp[t] for lp, t in zip(self.logprobs, self.token_ids))


@dataclass
class RequestOutput:
    """A request's prompt and its outputs; `finished` once every output has a finish reason."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
