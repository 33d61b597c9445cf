"""The OpenAI response shapes the gateway sends: whole responses, stream chunks, models.

What the OpenAPI document declares for the 200s of the generation routes and `/v1/models`;
`frontend.responses` fills them from the workers' steps. The request shapes are in
`frontend.protocol`.
"""

from __future__ import annotations

import time
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (not recomputed)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


LogprobsT = TypeVar("LogprobsT", bound=BaseModel)
ChoiceT = TypeVar("ChoiceT", bound="_Choice[Any]")


def _now_s() -> int:
    return int(time.time())


class _Choice(BaseModel, Generic[LogprobsT]):
    """What every choice carries: its index, its logprobs if asked, and why it finished (last step)."""

    index: int
    logprobs: LogprobsT | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Envelope(BaseModel, Generic[ChoiceT]):
    """What every response and chunk carries around its choices."""

    id: str
    object: str
    created: int = Field(default_factory=_now_s)
    model: str
    choices: list[ChoiceT]
    usage: UsageInfo | None = None


class CompletionChoice(_Choice[CompletionLogprobs]):
    text: str


class CompletionResponse(_Envelope[CompletionChoice]):
    """A whole completion, and each streamed chunk of one (OpenAI uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_Choice[ChatLogprobs]):
    message: ChatMessageOut


class ChatCompletionResponse(_Envelope[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Choice[ChatLogprobs]):
    delta: DeltaMessage


class ChatCompletionChunk(_Envelope[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now_s)
    owned_by: str = "splitserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
